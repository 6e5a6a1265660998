"""Forward and gradient parity of our Megatron Qwen-Image with diffusers' QwenImageTransformer2DModel (fp32)."""
import contextlib

import pytest
import torch

from checkpoints_convert.convert import mcore_state_from_hf
from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.parallel.testing import run_distributed
from tests.qwen_image_reference import (
    diffusers_reference, make_inputs, megatron_from_reference, reference_forward, rel_err, tiny_config,
)

TOL = 1e-5
# (batch, text_len, (frames, height, width) of the token grid, padding tokens per sample or None)
CASES = [
    (2, 7, (1, 4, 6), [0, 3]),  # non-square grid, one padded prompt
    (3, 5, (1, 6, 4), None),  # no mask at all
    (1, 6, (1, 5, 5), [2]),  # odd grid: centred RoPE takes more negative positions
    (2, 4, (2, 2, 3), [1, 0]),  # two frames
]


def _grad_errors(model, ref, arch, tp_rank, tp_size, tp_group=None):
    """Relative error of every Megatron gradient against the reference's, mapped through the table."""
    if tp_size > 1:
        # what megatron's finalize_model_grads does in training (config.qk_layernorm=True): QK-norm
        # grads are partial sums over this rank's heads until summed over the TP group
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                torch.distributed.all_reduce(p.grad, group=tp_group)
    # the last block's text stream feeds nothing: diffusers leaves those grads None, ours are exact zeros
    ref_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
    expected = mcore_state_from_hf(arch, ref_grads.__getitem__, tp_rank, tp_size)
    return {n: rel_err(p.grad, expected[n]) for n, p in model.named_parameters()}


def _parity_cases(model, ref, arch, tp_rank=0, tp_size=1, tp_group=None):
    results = []
    for batch, text_len, fhw, pad in CASES:
        img, txt, sigma, mask = make_inputs(arch, batch, text_len, fhw, pad)
        with torch.no_grad():
            expected = reference_forward(ref, img, txt, sigma, fhw, mask)
            out = model(img, txt, sigma, fhw, mask)
        results.append(rel_err(out, expected))
    # gradients: one case with padding, loss = <out, g> for a fixed random g
    img, txt, sigma, mask = make_inputs(arch, 2, 7, (1, 4, 6), [0, 3])
    g = torch.randn(2, 24, arch.out_features, generator=torch.Generator().manual_seed(5))
    ref.zero_grad()
    model.zero_grad()
    (reference_forward(ref, img, txt, sigma, (1, 4, 6), mask) * g).sum().backward()
    (model(img, txt, sigma, (1, 4, 6), mask) * g).sum().backward()
    return results, _grad_errors(model, ref, arch, tp_rank, tp_size, tp_group)


def test_mapping_table_names_every_parameter_once(single_rank):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    rules = qwen_image_rules(arch)
    assert sorted(r.mcore for r in rules) == sorted(k for k in model.state_dict() if not k.endswith("_extra_state"))
    assert sorted(h for r in rules for h in r.hf) == sorted(ref.state_dict())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


@pytest.mark.numerics
def test_forward_and_gradient_parity_tp1(single_rank):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, single_rank.tp_group)
    forward_errs, grad_errs = _parity_cases(model, ref, arch)
    print("TP=1 forward rel err per case:", forward_errs, "max grad rel err:", max(grad_errs.values()))
    assert max(forward_errs) <= TOL
    worst = max(grad_errs, key=grad_errs.get)
    assert grad_errs[worst] <= TOL, f"{worst}: {grad_errs[worst]}"


def _tp2_worker(state):
    arch = tiny_config()
    ref = diffusers_reference(arch)
    model = megatron_from_reference(ref, arch, state.tp_group)
    forward_errs, grad_errs = _parity_cases(model, ref, arch, state.tp_rank, state.tp, state.tp_group)
    return forward_errs, grad_errs


@pytest.mark.numerics
def test_forward_and_gradient_parity_tp2():
    for rank, (forward_errs, grad_errs) in enumerate(run_distributed(_tp2_worker, 2, parallel={"tp": 2})):
        print(f"TP=2 rank {rank} forward rel err per case:", forward_errs, "max grad:", max(grad_errs.values()))
        assert max(forward_errs) <= TOL
        worst = max(grad_errs, key=grad_errs.get)
        assert grad_errs[worst] <= TOL, f"rank {rank} {worst}: {grad_errs[worst]}"


def test_bad_inputs_name_the_shape(single_rank):
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    img, txt, sigma, mask = make_inputs(arch, 2, 5, (1, 4, 4), [0, 1])
    with pytest.raises(ValueError, match=r"image tokens have shape \(2, 16, 64\); expected \[B, 24, 64\]"):
        model(img, txt, sigma, (1, 4, 6), mask)
    with pytest.raises(ValueError, match="text mask has shape"):
        model(img, txt, sigma, (1, 4, 4), mask[:, :3])
    with pytest.raises(ValueError, match="timesteps have shape"):
        model(img, txt, sigma[:1], (1, 4, 4), mask)


def _cpu_bf16_attention():
    """The CPU's bf16 SDPA as this process can run it.  torch's flash kernel packs bf16 for AMX when the CPU has
    it, then refuses (``pack_vnni2 is only supported when avx512 is supported``) when ATEN_CPU_CAPABILITY forces a
    lower dispatch: a combination of no real machine (an AVX2 machine has no AMX), met when `make test`'s avx2 pass
    runs on an AMX Xeon.  There both models run the math backend; elsewhere the default choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, 1, 128, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, 1, 1, 128, dtype=torch.bool))
    except RuntimeError as e:
        if "pack_vnni2" not in str(e):
            raise
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


@pytest.mark.numerics
def test_bf16_forward_parity_on_cpu(single_rank):
    """bf16 rounding must follow diffusers' (sigma rounded to the model dtype, float32 sinusoid table)."""
    arch = tiny_config()
    ref = diffusers_reference(arch, dtype=torch.bfloat16)
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group, dtype=torch.bfloat16)
    fhw = (1, 8, 12)
    img, txt, sigma, mask = make_inputs(arch, 4, 32, fhw, [0, 5, 17, 31])
    with torch.no_grad(), _cpu_bf16_attention():
        err = rel_err(model(img.bfloat16(), txt.bfloat16(), sigma, fhw, mask),
                      reference_forward(ref, img.bfloat16(), txt.bfloat16(), sigma, fhw, mask))
    print(f"bf16 CPU rel err vs diffusers bf16: {err:.2e}")
    assert err <= 1e-2
