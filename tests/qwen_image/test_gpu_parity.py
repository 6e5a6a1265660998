"""bf16 parity with diffusers on a CUDA GPU (marker ``gpu``; skips itself without one).

Run on a GPU machine with ``make test-gpu`` (or ``python -m pytest -m gpu tests``)."""
import pytest
import torch

from megatron_omni.parallel.state import destroy_parallel, init_parallel
from tests.qwen_image_reference import (
    diffusers_reference, make_inputs, megatron_from_reference, reference_forward, rel_err, tiny_config,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_TOL = 1e-2
ARCHS = {
    "tiny": tiny_config(),
    # wide enough that bf16 rounding of real-size matmuls shows (hidden 1024, 8 heads of 128)
    "medium": tiny_config(num_layers=4, attention_head_dim=128, num_attention_heads=8, joint_attention_dim=512,
                          axes_dims_rope=(16, 56, 56)),
}


@pytest.fixture(scope="module")
def single_gpu():
    state = init_parallel(seed=0, device="cuda")
    yield state
    destroy_parallel()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_bf16_forward_parity_tp1(single_gpu, name):
    arch = ARCHS[name]
    dev = single_gpu.torch_device
    ref32 = diffusers_reference(arch).to(dev)
    ref16 = diffusers_reference(arch, dtype=torch.bfloat16).to(dev)
    ours = megatron_from_reference(diffusers_reference(arch), arch, single_gpu.tp_group, dtype=torch.bfloat16).to(dev)
    fhw = (1, 16, 24)  # non-square grid, 384 image tokens
    img, txt, sigma, mask = make_inputs(arch, 4, 32, fhw, [0, 5, 17, 31])
    img, txt, sigma, mask = img.to(dev), txt.to(dev), sigma.to(dev), mask.to(dev)
    with torch.no_grad():
        out = ours(img.bfloat16(), txt.bfloat16(), sigma, fhw, mask)
        expected16 = reference_forward(ref16, img.bfloat16(), txt.bfloat16(), sigma, fhw, mask)
        expected32 = reference_forward(ref32, img, txt, sigma, fhw, mask)
    err16, err32 = rel_err(out, expected16), rel_err(out, expected32)
    ref_gap = rel_err(expected16, expected32)
    print(f"\n[{name}] bf16 ours vs diffusers bf16: {err16:.2e}; ours bf16 vs diffusers fp32: {err32:.2e}; "
          f"diffusers bf16 vs fp32: {ref_gap:.2e}")
    assert out.dtype == torch.bfloat16
    assert err16 <= BF16_TOL
    assert err32 <= max(BF16_TOL, 1.5 * ref_gap)
