"""The FP8 rollout path (model_specs.common.fp8) in its CPU float32 emulation: the per-row quantization, the
emulated product against torch's own ``_scaled_mm`` (the kernel the GPU runs, with the same operand layout and
scales), the switched linears of a Qwen-Image model (FP8 only without autograd, re-quantized when the weights
change), and the engine sampling with it."""
import pytest
import torch

import model_specs.common.fp8 as fp8
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request
from model_specs.common.fp8 import E4M3_MAX, enable_fp8, fp8_linears, fp8_matmul, quantize_rows
from model_specs.qwen_image.model import QwenImageModel
from tests.qwen_image_reference import tiny_config
from tests.rollout.test_engine import ToyEncoder

ARCH = tiny_config()
FHW = (1, 4, 4)


def test_rows_quantize_to_e4m3_within_its_precision():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows over six decades
    t[5] = 0.0
    q, s = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1) and s.dtype == torch.float32
    assert torch.equal(s[:, 0][torch.arange(64) != 5], (t.abs().amax(1) / E4M3_MAX)[torch.arange(64) != 5])
    assert q.float().abs().amax(1)[6:].eq(E4M3_MAX).all()  # each row's largest element maps to e4m3's largest
    back = q.float() * s
    assert torch.equal(back[5], torch.zeros(96))  # an all-zero row: zeros, not NaN
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal numbers (those above the row's 2^-6 * scale)
    normal = t.abs() >= s * 2.0 ** -6
    assert ((back - t).abs() <= t.abs() * 2.0 ** -4)[normal].all()
    assert (back - t).abs().max() > 0  # (it does quantize)


def test_emulated_product_matches_torch_scaled_mm():
    """The emulation is the GPU kernel's math: torch's CPU ``_scaled_mm`` with the same operands (row-major x,
    column-major W^T, scales [M, 1] and [1, N], bf16 out) agrees to bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(80, 64, generator=g).bfloat16()
    wq, ws = quantize_rows(w)
    ours = fp8_matmul(x, wq, ws.t().contiguous())
    xq, xs = quantize_rows(x)
    theirs = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t().contiguous(), out_dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.shape == (48, 80)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 ** -7, atol=1e-2)
    exact = x.float() @ w.float().t()
    rel = (ours.float() - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.06  # FP8's error: present, and of e4m3's size


@pytest.fixture
def model(single_rank, monkeypatch):
    monkeypatch.setattr(fp8, "MIN_ROWS", 16)  # the tiny model's GEMMs have 16 x batch image rows
    torch.manual_seed(0)
    return QwenImageModel(ARCH, ARCH.transformer_config(1), single_rank.tp_group)


def _inputs(batch=2):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 16, ARCH.in_channels, generator=g), torch.randn(batch, 8, ARCH.joint_attention_dim,
                                                                               generator=g),
            torch.full((batch,), 0.5), FHW, None)


def test_switched_linears_run_fp8_without_autograd_only(model):
    with torch.no_grad():
        plain = model(*_inputs())
    switched = enable_fp8(model)
    names = [n for n, m in fp8_linears(model) if m._fp8_on]
    assert switched == len(names) and any(".linear_qkv" in n for n in names) and any("fc2" in n for n in names)
    with torch.no_grad():
        quantized = model(*_inputs())
    rel = (quantized - plain).norm() / plain.norm()
    # FP8's error, not another model (at megatron's init the blocks add little to the residual stream: ~2e-5 here)
    assert 1e-6 < rel < 1e-2, rel
    assert torch.equal(model(*_inputs()), plain)  # autograd on (the trainer): the model dtype's path, bit for bit
    enable_fp8(model, enable=False)
    with torch.no_grad():
        assert torch.equal(model(*_inputs()), plain)


def test_quantized_copies_follow_weight_changes(model):
    enable_fp8(model)
    linear = next(m for n, m in fp8_linears(model) if n.endswith("linear_proj"))
    before, scale, copy = linear.fp8_weight.clone(), linear.fp8_scale.clone(), linear.fp8_weight
    linear.refresh_fp8()
    assert linear.fp8_weight is copy  # unchanged weights: no re-quantization
    with torch.no_grad():
        linear.weight.mul_(2.0)  # a sync writes in place: the version counter moves
    linear.refresh_fp8()
    assert linear.fp8_weight is not copy  # re-quantized: the same codes at twice the scale
    assert torch.equal(linear.fp8_weight.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(linear.fp8_scale, scale * 2)
    # e4m3: 2^-4 relative for normal codes; the subnormal ones (below 2^-6 of the row scale) step by 2^-9 of it
    torch.testing.assert_close(linear.fp8_weight.float() * linear.fp8_scale.t(), linear.weight, rtol=2 ** -4,
                               atol=float(linear.fp8_scale.max()) * 2 ** -9)
    fp8.drop_fp8(model)
    with pytest.raises(RuntimeError, match="refresh_fp8"):
        with torch.no_grad():
            model(*_inputs())


def test_engine_samples_with_fp8_gemms_and_gelu_epilogue_yields(model):
    reqs = [Request(prompt="a red cat", img_fhw=FHW, num_steps=4, guidance_scale=4.0, seed=3, window_size=2,
                    window_range=(0, 2), noise_level=1.0)]
    bf = EmbeddedEngine(model, ARCH, ToyEncoder()).generate(reqs)[0]
    engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=True))
    assert engine.fp8 > 0
    mlp = model.blocks[0].mlp if hasattr(model.blocks[0], "mlp") else None
    if mlp is not None and hasattr(mlp, "fusable"):
        assert "FP8" in mlp.fusable() and not mlp.fused
    q = engine.generate(reqs)[0]
    assert not torch.equal(q.latents, bf.latents)
    rel = (q.latents - bf.latents).norm() / bf.latents.norm()
    assert rel < 1e-2  # (the rollout's own log-probs are the noise's alone: the trainer's re-scoring shows FP8's)


def test_engine_passes_the_accumulation_setting_to_every_switched_linear(model):
    """``rollout.fp8_fast_accum`` reaches each linear's kernel call (the GPU's ``use_fast_accum``; on by default)."""
    on = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=True))
    assert on.fp8 > 0 and all(m.fp8_fast_accum for _, m in fp8_linears(model) if m._fp8_on)
    off = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=True, fp8_fast_accum=False))
    switched = [m for _, m in fp8_linears(model) if m._fp8_on]
    assert off.fp8 == len(switched) > 0 and not any(m.fp8_fast_accum for m in switched)
