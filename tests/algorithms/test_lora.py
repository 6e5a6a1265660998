"""LoRA on the Megatron Qwen-Image (fused QKV included) equals a hand-built diffusers reference at TP=1 and
TP=2 (W + (α/r)·B·A per diffusers linear; adapter gradients (α/r)·Bᵀ·∂L/∂W and (α/r)·∂L/∂W·Aᵀ), and
diffusers + peft LoRA when peft is installed; merge, disable and freezing behave; errors name the bad value."""
import pytest
import torch

from checkpoints_convert.mapping import to_hf
from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.parallel.testing import run_distributed
from model_specs.common.lora import (
    FLOW_GRPO_TARGETS, apply_lora, disable_adapters, load_peft_state_dict, lora_modules, merge_lora, merged_state,
    peft_state_dict, resolve_targets,
)
from tests.qwen_image_reference import (
    diffusers_reference, make_inputs, megatron_from_reference, reference_forward, rel_err, tiny_config,
)

TOL = 1e-5
RANK, ALPHA = 4, 8.0
FHW = (1, 4, 6)
# (name, targets): every linear of the blocks + a replicated global linear; a partial fused QKV
TARGET_SETS = {
    "all": [*FLOW_GRPO_TARGETS, "img_mod.1", "txt_mod.1", "proj_out"],
    "partial_qkv": ["to_k", "add_q_proj", "add_v_proj", "img_mlp.net.2"],
}


def _random_adapters(arch, targets, seed=3):
    """Non-zero peft-named adapters for every diffusers linear ``targets`` selects."""
    shapes = {k: v.shape for k, v in diffusers_reference(arch).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for target in resolve_targets(qwen_image_rules(arch), targets):
        for hf in target.hf:
            n_out, n_in = shapes[f"{hf}.weight"]
            out[f"{hf}.lora_A.weight"] = torch.randn(RANK, n_in, generator=g) * n_in ** -0.5
            out[f"{hf}.lora_B.weight"] = torch.randn(n_out, RANK, generator=g) * 0.2
    return out


def _hf_modules(adapters):
    return sorted({name.removesuffix(".lora_A.weight") for name in adapters if name.endswith(".lora_A.weight")})


def _hand_reference(arch, adapters):
    """diffusers reference whose every adapted linear holds W + (α/r)·B·A."""
    ref = diffusers_reference(arch)
    with torch.no_grad():
        for m in _hf_modules(adapters):
            a, b = adapters[f"{m}.lora_A.weight"], adapters[f"{m}.lora_B.weight"]
            ref.get_submodule(m).weight += ALPHA / RANK * b @ a
    return ref


def _hand_grads(ref, adapters):
    """Adapter gradients from the merged weights' gradient G: ∂L/∂A = (α/r)·Bᵀ·G, ∂L/∂B = (α/r)·G·Aᵀ
    (the last block's text stream feeds nothing: diffusers leaves those grads None)."""
    out = {}
    for m in _hf_modules(adapters):
        w = ref.get_submodule(m).weight
        grad = torch.zeros_like(w) if w.grad is None else w.grad
        a, b = adapters[f"{m}.lora_A.weight"], adapters[f"{m}.lora_B.weight"]
        out[f"{m}.lora_A.weight"] = ALPHA / RANK * b.T @ grad
        out[f"{m}.lora_B.weight"] = ALPHA / RANK * grad @ a.T
    return out


def _lora_model(arch, tp_group, targets, adapters):
    model = megatron_from_reference(diffusers_reference(arch), arch, tp_group)
    apply_lora(model, RANK, ALPHA, targets, qwen_image_rules(arch))
    load_peft_state_dict(model, adapters)
    return model


def _forward_and_grads(model, ref, expected_grads_fn, arch):
    """(output rel err, {peft name: adapter grad rel err}) for loss = <out, g>."""
    img, txt, sigma, mask = make_inputs(arch, 2, 7, FHW, [0, 3])
    g = torch.randn(2, 24, arch.out_features, generator=torch.Generator().manual_seed(5))
    ref.zero_grad()
    expected = reference_forward(ref, img, txt, sigma, FHW, mask)
    (expected * g).sum().backward()
    out = model(img, txt, sigma, FHW, mask)
    (out * g).sum().backward()
    grads, expected_grads = peft_state_dict(model, grad=True), expected_grads_fn(ref)
    assert sorted(grads) == sorted(expected_grads)
    return rel_err(out, expected.detach()), {n: rel_err(grads[n], expected_grads[n]) for n in grads}


def _merged_hf(model, arch, tp_group):
    """The merged weights as whole diffusers tensors (TP shards gathered along the table's tp_dim)."""
    state = merged_state(model)
    out = {}
    for rule in qwen_image_rules(arch):
        t = state[rule.mcore]
        if rule.tp_dim is not None and tp_group.size() > 1:
            parts = [torch.empty_like(t) for _ in range(tp_group.size())]
            torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=rule.tp_dim)
        out.update(to_hf(rule, t, arch.num_attention_heads))
    return out


def _lora_cases(tp_group):
    """Everything the TP=1 and TP=2 tests compare, for each target set."""
    arch = tiny_config()
    results = {}
    for name, targets in TARGET_SETS.items():
        adapters = _random_adapters(arch, targets)
        model, ref = _lora_model(arch, tp_group, targets, adapters), _hand_reference(arch, adapters)
        forward_err, grad_errs = _forward_and_grads(model, ref, lambda r: _hand_grads(r, adapters), arch)
        results[name] = {"forward": forward_err, "grads": grad_errs, "merged": _merged_hf(model, arch, tp_group),
                         "peft": peft_state_dict(model), "peft_grads": peft_state_dict(model, grad=True)}
    return results


def _tp2_worker(state):
    return _lora_cases(state.tp_group)


def _check_against_reference(results, where):
    for name, r in results.items():
        worst = max(r["grads"], key=r["grads"].get)
        print(f"{where} {name}: forward rel err {r['forward']:.1e}, worst adapter grad {worst} {r['grads'][worst]:.1e}")
        assert r["forward"] <= TOL, (where, name)
        assert r["grads"][worst] <= TOL, (where, name, worst)


@pytest.mark.numerics
def test_lora_tp1_and_tp2_equal_the_hand_reference_and_each_other(single_rank):
    tp1 = _lora_cases(single_rank.tp_group)
    _check_against_reference(tp1, "TP=1")
    for rank, tp2 in enumerate(run_distributed(_tp2_worker, 2, parallel={"tp": 2})):
        _check_against_reference(tp2, f"TP=2 rank {rank}")
        for name in TARGET_SETS:
            for key in ("merged", "peft", "peft_grads"):
                a, b = tp2[name][key], tp1[name][key]
                assert sorted(a) == sorted(b)
                errs = {n: rel_err(a[n], b[n]) for n in a}
                assert max(errs.values()) <= TOL, (rank, name, key, max(errs, key=errs.get))


def _peft_models(arch, tp_group, targets):
    """(our model with LoRA, diffusers reference with peft LoRA) holding the same weights and adapters;
    peft's A and B are both random (init_lora_weights=False), so the adapters change the output."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, tp_group)
    ref.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False))
    apply_lora(model, RANK, ALPHA, targets, qwen_image_rules(arch))
    load_peft_state_dict(model, get_peft_model_state_dict(ref))
    return model, ref


def _peft_grads(ref):
    """peft's adapter gradients under peft's export names (None, for the unused last text stream, as 0)."""
    return {n.replace(".default", ""): torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in ref.named_parameters() if "lora_" in n}


@pytest.mark.numerics
def test_lora_equals_diffusers_with_peft(single_rank):
    pytest.importorskip("peft")
    arch = tiny_config()
    results = {}
    for name, targets in TARGET_SETS.items():
        model, ref = _peft_models(arch, single_rank.tp_group, targets)
        results[name] = dict(zip(("forward", "grads"), _forward_and_grads(model, ref, _peft_grads, arch)))
    _check_against_reference(results, "TP=1 vs peft")


def test_fused_qkv_targets_and_names(single_rank):
    arch = tiny_config(num_layers=1)
    found = {t.mcore: t for t in resolve_targets(qwen_image_rules(arch), ["to_k", "to_v", "add_q_proj", "proj_out"])}
    assert found["blocks.0.attention.linear_qkv"].parts == (1, 2)
    assert found["blocks.0.attention.linear_qkv"].hf == ("transformer_blocks.0.attn.to_k",
                                                        "transformer_blocks.0.attn.to_v")
    assert found["blocks.0.attention.linear_added_qkv"].parts == (0,)
    assert found["proj_out"].n_fused == 1 and len(found) == 3
    with pytest.raises(ValueError, match=r"LoRA targets \['to_z'\] match no module"):
        resolve_targets(qwen_image_rules(arch), ["to_q", "to_z"])


@pytest.mark.numerics
def test_freeze_disable_merge(single_rank):
    arch = tiny_config()
    img, txt, sigma, mask = make_inputs(arch, 2, 5, FHW, [0, 2])
    model = _lora_model(arch, single_rank.tp_group, TARGET_SETS["all"], _random_adapters(arch, TARGET_SETS["all"]))
    plain = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * len(lora_modules(model))
    with torch.no_grad():
        base_out = plain(img, txt, sigma, FHW, mask)
        lora_out = model(img, txt, sigma, FHW, mask)
        with disable_adapters(model) as reference:
            disabled_out = reference(img, txt, sigma, FHW, mask)
        assert rel_err(model(img, txt, sigma, FHW, mask), lora_out) == 0.0  # enabled again after the block
        assert rel_err(lora_out, base_out) > 1e-2  # the adapters matter
        assert torch.equal(disabled_out, base_out)
        plain.load_state_dict(merged_state(model))  # plain names, merged weights
        assert rel_err(plain(img, txt, sigma, FHW, mask), lora_out) <= TOL
        merge_lora(model)
        assert not lora_modules(model) and sorted(model.state_dict()) == sorted(plain.state_dict())
        assert rel_err(model(img, txt, sigma, FHW, mask), lora_out) <= TOL


def test_zero_B_init_and_checkpoint_keys(single_rank):
    arch = tiny_config(num_layers=1)
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    keys_before = set(model.sharded_state_dict())
    img, txt, sigma, mask = make_inputs(arch, 1, 5, FHW)
    with torch.no_grad():
        before = model(img, txt, sigma, FHW, mask)
        apply_lora(model, RANK, ALPHA, ["to_q", "to_out.0"], qwen_image_rules(arch))
        assert torch.equal(model(img, txt, sigma, FHW, mask), before)  # B = 0: the model is unchanged
    keys_after = set(model.sharded_state_dict())
    assert keys_after - keys_before == {f"blocks.0.attention.{m}.lora_{x}" for m in ("linear_qkv", "linear_proj")
                                        for x in "AB"}
    assert keys_before <= keys_after  # base weights keep their checkpoint keys
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, RANK, ALPHA, ["to_q"], qwen_image_rules(arch))
