"""The FP8 rollout path (model_specs.common.fp8) in its CPU float32 emulation: the per-row quantization, the
emulated product against torch's own ``_scaled_mm`` (the kernel the GPU runs, with the same operand layout and
scales), the switched linears of a Qwen-Image model (FP8 only without autograd, re-quantized when the weights
change), and the engine sampling with it."""
import os
import subprocess
import sys

import pytest
import torch

import model_specs.common.fp8 as fp8
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request
from model_specs.common.fp8 import E4M3_MAX, fp8_matmul, quantize_rows
from model_specs.common.rollout_linear import drop_rollout_weights, enable_fp8, rollout_linears
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
    names = [n for n, m in rollout_linears(model) if m._fp8_on]
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


def test_per_sample_linears_stay_in_the_model_dtype_and_short_text_streams_switch(model, monkeypatch):
    """The timestep embedder's linears (``per_sample``: the batch's rows, whose output modulates every token) are
    never switched, whatever their rows; every block linear is; a text stream of MIN_ROWS rows (2 prompts x 8
    tokens: a batch's short negative prompt) runs its products in FP8, one of fewer rows in the model dtype."""
    enable_fp8(model)
    switched = {n for n, m in rollout_linears(model) if m._fp8_on}
    assert not {"time_linear_1", "time_linear_2"} & switched
    assert switched == {n for n, _ in rollout_linears(model) if n.startswith("blocks.")}
    rows = []
    real = fp8.scaled_product
    monkeypatch.setattr(fp8, "scaled_product", lambda x_q, *a, **k: rows.append(x_q.shape[0]) or real(x_q, *a, **k))
    for batch, text_fp8 in ((2, True), (1, False)):
        rows.clear()
        with torch.no_grad():
            model(*_inputs(batch))
        blocks = len(model.blocks)
        # per block: QKV, out projection, fc1, fc2 of the image stream (16 x batch rows), and of the text stream's
        # 8 x batch rows from MIN_ROWS on
        assert sorted(set(rows)) == ([8 * batch, 16 * batch] if text_fp8 else [16 * batch])
        assert len(rows) == blocks * 4 * (2 if text_fp8 else 1)


def test_quantized_copies_follow_weight_changes(model):
    enable_fp8(model)
    linear = next(m for n, m in rollout_linears(model) if n.endswith("linear_proj"))
    before, scale, copy = linear.fp8_weight.clone(), linear.fp8_scale.clone(), linear.fp8_weight
    linear.refresh_rollout()
    assert linear.fp8_weight is copy  # unchanged weights: no re-quantization
    with torch.no_grad():
        linear.weight.mul_(2.0)  # a sync writes in place: the version counter moves
    linear.refresh_rollout()
    assert linear.fp8_weight is not copy  # re-quantized: the same codes at twice the scale
    assert torch.equal(linear.fp8_weight.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(linear.fp8_scale, scale * 2)
    # e4m3: 2^-4 relative for normal codes; the subnormal ones (below 2^-6 of the row scale) step by 2^-9 of it
    torch.testing.assert_close(linear.fp8_weight.float() * linear.fp8_scale.t(), linear.weight, rtol=2 ** -4,
                               atol=float(linear.fp8_scale.max()) * 2 ** -9)
    drop_rollout_weights(model)
    with pytest.raises(RuntimeError, match="refresh_rollout_weights"):
        with torch.no_grad():
            model(*_inputs())


def test_engine_samples_with_fp8_gemms_and_fused_mlps(model):
    reqs = [Request(prompt="a red cat", img_fhw=FHW, num_steps=4, guidance_scale=4.0, seed=3, window_size=2,
                    window_range=(0, 2), noise_level=1.0)]
    bf = EmbeddedEngine(model, ARCH, ToyEncoder()).generate(reqs)[0]
    engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=True))
    assert engine.fp8 > 0
    mlp = model.blocks[0].mlp if hasattr(model.blocks[0], "mlp") else None
    if mlp is not None and hasattr(mlp, "fusable"):  # fc1's FP8 output reaches fc2 quantized (one pass)
        assert mlp.fusable() == "" and mlp.fused and mlp.fused_weight is None
    q = engine.generate(reqs)[0]
    assert not torch.equal(q.latents, bf.latents)
    rel = (q.latents - bf.latents).norm() / bf.latents.norm()
    assert rel < 1e-2  # (the rollout's own log-probs are the noise's alone: the trainer's re-scoring shows FP8's)


def test_engine_passes_the_accumulation_setting_to_every_switched_linear(model):
    """``rollout.fp8_fast_accum`` reaches each linear's kernel call (the GPU's ``use_fast_accum``; on by default)."""
    on = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=True))
    assert on.fp8 > 0 and all(m.fp8_fast_accum for _, m in rollout_linears(model) if m._fp8_on)
    off = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=True, fp8_fast_accum=False))
    switched = [m for _, m in rollout_linears(model) if m._fp8_on]
    assert off.fp8 == len(switched) > 0 and not any(m.fp8_fast_accum for m in switched)


def _gelu_quantize_vs_reference(device: str, dtype: torch.dtype, n: int = 1000):
    """The one-pass bias + GELU-tanh + per-row quantization against the unfused path's torch ops: the activation
    to its dtype's rounding, the scales to float32's, the quantized values within one e4m3 step (a different
    rounding of GELU or of the division can move a value across a rounding boundary); the same kernel without
    GELU on a weight against ``quantize_rows``."""
    g = torch.Generator().manual_seed(4)
    y = (torch.randn(37, n, generator=g) * 2).to(device, dtype)
    y[3] = 0.0  # an all-zero row after the bias below is removed for this row's check: scale floor
    bias = torch.randn(n, generator=g).to(device, dtype)
    lora = (torch.randn(37, n, generator=g) * 0.1).to(device, dtype)
    for b, lo, keep in ((bias, lora, True), (None, None, False), (bias, None, True)):
        a, q, s = fp8.gelu_quantize_rows(y, b, lo, keep)
        ra, rq, rs = fp8._gelu_quantize_reference(y, b, lo)
        assert q.dtype == fp8.E4M3 and s.shape == (37, 1) and s.dtype == torch.float32
        if keep:
            assert a.dtype == dtype and a.shape == y.shape
            torch.testing.assert_close(a.float(), ra.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                       atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        else:
            assert a.numel() == 0
        torch.testing.assert_close(s, rs, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
        step = (rq.float().abs() * 2.0 ** -3).clamp_min(2.0 ** -9)  # one e4m3 step at each value
        assert ((q.float() - rq.float()).abs() <= step + 1e-6).all()
        assert (q.float() == rq.float()).float().mean() > 0.97  # most values round the same
    # without GELU: a weight's rows over six decades of scales (the rollout's copies: ``quantize_weight_rows``)
    w = (torch.randn(37, n, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(device, dtype)
    q, s = fp8.quantize_weight_rows(w)
    rq, rs = quantize_rows(w)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    step = (rq.float().abs() * 2.0 ** -3).clamp_min(2.0 ** -9)
    assert ((q.float() - rq.float()).abs() <= step + 1e-6).all() and (q.float() == rq.float()).float().mean() > 0.97


def _e4m3_rounding_vs_torch(device: str) -> None:
    """The row kernel's e4m3 codes bit for bit against torch's cast (round to nearest even, saturating here by the
    clamp): every e4m3 value, each midpoint between neighbours (ties) and the float32 values either side of it, in
    both signs, the subnormals, values that round to -0 and -0 itself.  The weight-copy launch (no GELU) over rows
    whose largest magnitude is 448, so that the scale is exactly 1 and the codes are the values' own rounding."""
    grid = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()  # 0, the subnormals 2^-9.., the normals ..448
    mid = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1]),
                   torch.tensor([2.0 ** -11, 2.0 ** -10, 3 * 2.0 ** -11, 1e-30])])
    v = torch.cat([v, -v, torch.tensor([-0.0])])
    v = torch.cat([v, v.new_zeros((-v.numel()) % 255)]).view(-1, 255)
    rows = torch.cat([v, torch.full((v.shape[0], 1), E4M3_MAX)], dim=1).to(device)  # each row's max: 448 -> scale 1
    q, s = fp8.quantize_weight_rows(rows)
    assert torch.equal(s, torch.ones_like(s))
    ours, theirs = q.view(torch.uint8).cpu(), rows.cpu().to(fp8.E4M3).view(torch.uint8)
    differ = ours != theirs
    assert not differ.any(), (f"{int(differ.sum())} codes differ: values {rows.cpu()[differ][:6].tolist()} gave bytes "
                              f"{ours[differ][:6].tolist()}, torch's {theirs[differ][:6].tolist()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_kernel_rounds_as_torch_on_gpu():
    """The product's GPU path: the hardware's cast."""
    _e4m3_rounding_vs_torch("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", [None, (16384, 16), (2048, 4)])  # the product's launch_of, whole rows, chunks
@pytest.mark.parametrize("tanh_approx", [False, True])  # the exact tanh, tanh.approx.f32 (bf16 rows; the default)
def test_gelu_quantize_kernel_equals_torch_ops_on_gpu(dtype, launch, tanh_approx, monkeypatch):
    monkeypatch.setattr(fp8, "_LAUNCH", launch)
    monkeypatch.setattr(fp8, "TANH_APPROX", tanh_approx)
    _gelu_quantize_vs_reference("cuda", dtype, n=12288)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gelu_tanh_approximation_moves_few_codes_by_one_step_on_gpu(monkeypatch):
    """GELU on bf16 rows with ``fp8.TANH_APPROX`` (the hardware's tanh.approx.f32) against the exact tanh's:
    the instruction is in use (some codes differ: on random rows ~0.1 %), each differing code is one e4m3 step
    from the exact one, the scales within bf16's rounding of the row maximum; float32 rows keep the exact tanh."""
    g = torch.Generator(device="cuda").manual_seed(5)
    y = (torch.randn(2048, 12288, device="cuda", generator=g) * 2).bfloat16()
    bias = torch.randn(12288, device="cuda", generator=g).bfloat16()
    monkeypatch.setattr(fp8, "TANH_APPROX", True)
    _, q, s = fp8.gelu_quantize_rows(y, bias, None, False)
    monkeypatch.setattr(fp8, "TANH_APPROX", False)
    _, rq, rs = fp8.gelu_quantize_rows(y, bias, None, False)
    differ = q.view(torch.uint8) != rq.view(torch.uint8)
    assert 0 < differ.float().mean() < 1e-2, float(differ.float().mean())
    step = (rq.float().abs() * 2.0 ** -3).clamp_min(2.0 ** -9)
    assert ((q.float() - rq.float()).abs() <= step + 1e-6).all()
    torch.testing.assert_close(s, rs, rtol=2 ** -7, atol=0)
    y32 = y.float()[:64]
    exact32 = fp8.gelu_quantize_rows(y32, bias.float(), None, False)[1]
    monkeypatch.setattr(fp8, "TANH_APPROX", True)
    assert torch.equal(fp8.gelu_quantize_rows(y32, bias.float(), None, False)[1].view(torch.uint8),
                       exact32.view(torch.uint8))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter only")
@pytest.mark.parametrize("launch", [None, (64, 4)])  # the whole row in one block; four blocks, the last one partial
def test_gelu_quantize_kernel_interpreted(launch, monkeypatch):
    monkeypatch.setattr(fp8, "_LAUNCH", launch)
    _gelu_quantize_vs_reference("cpu", torch.float32, n=200)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter only")
def test_row_kernel_rounds_as_torch_interpreted():
    _e4m3_rounding_vs_torch("cpu")


def test_gelu_quantize_kernel_on_cpu():
    """The kernel's logic (row blocks, masks, the bias / LoRA inputs, the kept activation) in Triton's CPU
    interpreter; a subprocess, as Triton reads TRITON_INTERPRET when it decorates the kernel."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_gelu_quantize_kernel_interpreted",
                          f"{__file__}::test_row_kernel_rounds_as_torch_interpreted"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_row_kernel_launch_follows_the_measured_rule():
    """Whole rows for the merged adapters' fc1 -> fc2 and the weight copies; chunks of 1024 over 4 warps where the
    LoRA output is read and the activation kept, from a GPU's worth of rows (bench/gelu_quantize.py's table)."""
    pytest.importorskip("triton")
    assert fp8.launch_of(16384, 12288, reads_lora=False) == (16384, 8)
    assert fp8.launch_of(16384, 12288, reads_lora=True) == (1024, 4)
    assert fp8.launch_of(fp8.CHUNKED_MIN_ROWS - 1, 12288, reads_lora=True) == (16384, 8)
    assert fp8.launch_of(12288, 3072, reads_lora=False) == (4096, 4)
    assert fp8.launch_of(37, 200, reads_lora=True) == (256, 4)


@pytest.mark.parametrize("lora", [False, True])
def test_fp8_mlp_hands_fc2_its_input_quantized(model, lora):
    """With FP8 on, the MLP's fused path (fc1's FP8 product, then bias + GELU + fc2's quantization in one pass, then
    fc2's kernel on the quantized input) computes what megatron's MLP forward computes with the same FP8 linears,
    with and without LoRA adapters on fc1 and fc2; on the GPU the same pass is the Triton kernel."""
    from model_specs.common.fusion import fuse_inference
    from model_specs.common.gelu_mlp import GeluMLP
    from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
    from checkpoints_convert.qwen_image import qwen_image_rules

    if lora:
        apply_lora(model, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=0)
        for m in (mod for mod in model.modules() if hasattr(mod, "lora_B")):
            torch.nn.init.normal_(m.lora_B, std=0.02, generator=torch.Generator().manual_seed(2))
    enable_fp8(model)
    with torch.no_grad():
        unfused = model(*_inputs())
    assert fuse_inference(model) > 0
    mlps = [m for m in model.modules() if isinstance(m, GeluMLP)]
    assert mlps and all(m.fused and m.fusable() == "" and m.fused_weight is None for m in mlps)
    calls = []
    real = fp8.gelu_quantize_rows
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8, "gelu_quantize_rows", lambda *a: calls.append(a[2] is not None) or real(*a))
        fused = model(*_inputs())
    assert len(calls) == 2 * len(model.blocks) and all(c == lora for c in calls)  # image and text MLPs, each block
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
