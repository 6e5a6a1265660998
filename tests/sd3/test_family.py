"""SD3 as a registered model family: what generic code can ask it, its FLOPs table against diffusers' own linears,
LoRA through its mapping table, and bf16 rounding that follows diffusers'."""
import pytest
import torch

from model_specs.common.lora import apply_lora, peft_state_dict
from model_specs.family import family_for_class, get_family
from model_specs.sd3.config import SD3Config, sd35_medium
from model_specs.sd3.family import SD3_LORA_TARGETS
from model_specs.sd3.flops import _linears, forward_flops, lora_forward_flops
from tests.sd3.reference import (
    SHAPES, diffusers_reference, make_inputs, megatron_from_reference, reference_forward, rel_err, tiny_config,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_registry_finds_the_family_and_says_what_is_missing(tmp_path):
    family = get_family("sd3")
    assert family_for_class("SD3Transformer2DModel") is family
    assert family.default_arch() == sd35_medium() and isinstance(family.default_arch(), SD3Config)
    arch = tiny_config()
    assert family.arch_from_config(family.arch_to_config(arch)) == arch
    assert (family.num_blocks(arch), family.num_heads(arch), family.text_dim(arch), family.latent_channels(arch)) \
        == (3, 4, 32, 64)
    with pytest.raises(ValueError, match=r"tp\*ulysses = 1\*8 does not divide num_attention_heads=4"):
        family.check_layout(arch, tp=1, ulysses=8)
    # per-block rules: the dual-attention block has attn2, the last (context_pre_only) block no text output
    names = [{h for r in family.block_rules(arch, i) for h in r.hf} for i in range(arch.num_layers)]
    assert any(".attn2." in n for n in names[0]) and "transformer_blocks.2.attn.to_add_out.weight" not in names[2]
    assert family.rules(arch) == family.global_rules() + [r for i in range(3) for r in family.block_rules(arch, i)]


def test_family_build_at_tp1_runs(single_rank):
    family, arch = get_family("sd3"), tiny_config()
    model = family.build(arch, family.transformer_config(arch), single_rank.tp_group)
    img, txt, pooled, sigma = make_inputs(arch, 2, 3, (2, 4))
    with torch.no_grad():
        assert model(img, txt, sigma, (1, 2, 4), None, pooled).shape == (2, 8, arch.out_features)


@pytest.mark.parametrize("shape", SHAPES)
def test_flops_table_names_every_diffusers_linear(shape):
    arch = tiny_config(**SHAPES[shape])
    ref = diffusers_reference(arch)
    theirs = {name: (m.weight[0].numel(), m.weight.shape[0]) for name, m in ref.named_modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    assert {name: dims[:2] for name, dims in _linears(arch).items()} == theirs
    # one token of each kind at batch 1: matmuls + attention over the 2 joint tokens (+ attn2's image token)
    assert forward_flops(arch, 1, 1, 1) == sum(2 * k * n for k, n, _ in _linears(arch).values()) \
        + arch.num_layers * 16 * arch.hidden_size + len(arch.dual_attention_layers) * 4 * arch.hidden_size
    with pytest.raises(ValueError, match=r"LoRA targets \['img_mlp.net.2'\] name no SD3 linear"):
        lora_forward_flops(arch, 4, ["img_mlp.net.2"], 1, 4, 4)


def test_lora_preset_wraps_the_joint_attention_and_names_adapters_as_peft(single_rank):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    img, txt, pooled, sigma = make_inputs(arch, 2, 4, (2, 3))
    with torch.no_grad():
        before = model(img, txt, sigma, (1, 2, 3), None, pooled)
    wrapped = apply_lora(model, 4, 8, SD3_LORA_TARGETS, get_family("sd3").rules(arch))
    # per block: image and text QKV, to_out; to_add_out in all but the last block
    assert len(wrapped) == 3 * arch.num_layers + arch.num_layers - 1
    with torch.no_grad():
        assert torch.equal(model(img, txt, sigma, (1, 2, 3), None, pooled), before)  # B = 0 at init
    names = set(peft_state_dict(model))
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in names
    assert "transformer_blocks.2.attn.add_v_proj.lora_B.weight" in names
    assert not any("attn2" in n or "to_add_out" in n and ".2." in n for n in names)
    assert lora_forward_flops(arch, 4, SD3_LORA_TARGETS, 1, 6, 4) > 0


@pytest.mark.numerics
def test_bf16_forward_follows_diffusers_rounding(single_rank):
    """Our bf16 forward is no farther from diffusers' bf16 one than bf16 rounding itself moves diffusers (its bf16
    vs float32 forward): a step rounded differently (e.g. the timestep rounded to bf16 before its x1000) is not."""
    arch = tiny_config()
    ref32, ref16 = diffusers_reference(arch), diffusers_reference(arch, dtype=torch.bfloat16)
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group, dtype=torch.bfloat16)
    img, txt, pooled, sigma = make_inputs(arch, 3, 6, (4, 6))
    with torch.no_grad():
        exact = reference_forward(ref32, arch, img, txt, pooled, sigma, (4, 6))
        img, txt, pooled = img.bfloat16(), txt.bfloat16(), pooled.bfloat16()
        theirs = reference_forward(ref16, arch, img, txt, pooled, sigma, (4, 6))
        err, noise = rel_err(model(img, txt, sigma, (1, 4, 6), None, pooled), theirs), rel_err(theirs, exact)
    print(f"bf16 CPU rel err vs diffusers bf16: {err:.2e} (diffusers bf16 vs float32: {noise:.2e})")
    assert err <= 1.5 * noise


@pytest.mark.numerics
def test_inference_fusions_take_the_mlps(single_rank):
    """The rollout's switch (fuse_inference) reaches SD3's GELU-tanh MLPs (fc1 + GELU in the GEMM epilogue on CUDA;
    the same math as torch ops here): every block's image MLP and all but the last block's text MLP; and its
    attentions (the q / k norm kernel, e4849ca): every block's joint one and the dual-attention blocks' image-only
    one."""
    from model_specs.common.fusion import fuse_inference

    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    img, txt, pooled, sigma = make_inputs(arch, 2, 5, (3, 4))
    with torch.no_grad():
        plain = model(img, txt, sigma, (1, 3, 4), None, pooled)
        mlps, attentions = 2 * arch.num_layers - 1, arch.num_layers + len(arch.dual_attention_layers)
        assert fuse_inference(model, strict=True) == mlps + attentions
        err = rel_err(model(img, txt, sigma, (1, 3, 4), None, pooled), plain)
    fuse_inference(model, enable=False)
    assert err <= 1e-6
