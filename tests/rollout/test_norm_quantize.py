"""The adaLN path's one-pass FP8 input (model_specs.common.norm_quantize): its torch ops against the Qwen-Image
block's own, its Triton kernel against them in Triton's CPU interpreter (and on a GPU), its input checks."""
import os
import subprocess
import sys

import pytest
import torch

from model_specs.common import fp8, norm_quantize
from model_specs.common.norm_quantize import norm_modulate_quantize_rows, norm_quantize_reference
from model_specs.qwen_image.layers import _modulate

S, B, H, EPS = 7, 3, 200, 1e-6  # H: not a power of two (the kernel's masked tail)
# bit-equality with the block's own ops holds where the op runs them (not the kernel in Triton's interpreter)
TORCH_OPS = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the op's torch ops, not the kernel")


def _inputs(device, dtype, mod_rows=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(S, B, H, generator=g) * 3 + 0.5).to(device, dtype)
    r = torch.randn(S, B, H, generator=g).to(device, dtype)
    mod = (torch.randn(mod_rows, 6 * H, generator=g) * 0.5).to(device, dtype)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]  # views with the modulation's row stride, as the blocks pass
    return x, r, shift, scale, gate


def test_reference_is_the_blocks_own_ops():
    """The torch ops the kernel mirrors are the block's: the gated residual, then ``_modulate(LayerNorm(x'))``."""
    x, r, shift, scale, gate = _inputs("cpu", torch.bfloat16)
    norm = torch.nn.LayerNorm(H, eps=EPS, elementwise_affine=False)
    xn, m, q, s = norm_quantize_reference(x, shift, scale, EPS, r, gate)
    block_x = x + gate[None] * r
    assert torch.equal(xn, block_x) and torch.equal(m, _modulate(norm(block_x), shift, scale))
    rq, rs = fp8.quantize_rows(m.reshape(-1, H))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@TORCH_OPS
def test_op_without_the_kernel_returns_the_reference_and_empties():
    """On a CPU without the interpreter: the torch ops; x' only with a residual, m only when asked for."""
    x, r, shift, scale, gate = _inputs("cpu", torch.float32)
    xn, m, q, s = norm_modulate_quantize_rows(x, shift, scale, EPS, None, None, False)
    assert xn.numel() == 0 and m.numel() == 0 and q.shape == (S * B, H) and s.shape == (S * B, 1)
    rq, rs = norm_quantize_reference(x, shift, scale, EPS)[2:]
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("bad, match", [
    (dict(shift=torch.zeros(2, H)), r"shift has shape \(2, 200\).*expected \[1 or 3, 200\]"),
    (dict(scale=torch.zeros(B, H + 1)), r"scale has shape \(3, 201\)"),
    (dict(residual=torch.zeros(S, B, H - 1)), r"residual \(7, 3, 199\); expected x's \(7, 3, 200\)"),
    (dict(gate=None), "a residual needs its gate"),
    (dict(bias=torch.zeros(H + 2)), r"bias \(202,\); expected \[200\] with a residual"),
    (dict(bias=torch.zeros(H), residual=None, gate=None), r"bias \(200,\) without a residual"),
])
def test_bad_inputs_name_the_value(bad, match):
    x, r, shift, scale, gate = _inputs("cpu", torch.float32)
    args = dict(shift=shift, scale=scale, residual=r, gate=gate, bias=None) | bad
    with pytest.raises(ValueError, match=match):
        norm_modulate_quantize_rows(x, args["shift"], args["scale"], EPS, args["residual"], args["gate"], False,
                                    args["bias"])


@pytest.mark.parametrize("text, launch", [("4,8,false", (4, 8, False)), (" 1, 16, True", (1, 16, True))])
def test_parse_launch(text, launch):
    assert norm_quantize.parse_launch(text) == launch


@pytest.mark.parametrize("text", ["3,8,false", "4,8", "4,64,true", "4,8,maybe", "0,8,true", "a,8,true"])
def test_parse_launch_names_the_bad_value(text):
    with pytest.raises(ValueError, match=f"adaLN kernel launch {text!r}: expected ROWS,WARPS,ROUND"):
        norm_quantize.parse_launch(text)


# (rows per program, warps, eager's roundings): the product's launch_of (None), several rows per program over a row
# count they do not divide (S·B = 21), float32 between the ops (inductor's arithmetic)
LAUNCHES = [None, (4, 4, True), (2, 8, False)]


def _kernel_vs_reference(device: str, dtype: torch.dtype, launch, monkeypatch) -> None:
    """Eager's roundings: x' bit for bit (the same rounded ops), m to its dtype's rounding and, in a 16-bit dtype,
    bit-equal but where the statistics' float32 sums round apart (ordered differently); float32 between the ops:
    against ``fused_reference`` (the same ops in float32), x' and m to their dtype's rounding.  The scales to m's,
    the codes within one e4m3 step and mostly equal; a modulation of one row for the batch and one per sample; with
    and without a residual (and its bias), m kept or not."""
    monkeypatch.setattr(norm_quantize, "_LAUNCH", launch)
    rounds = (launch or norm_quantize.launch_of(H))[2]
    tight = dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if tight else dict(rtol=2 ** -7, atol=2 ** -7)
    for mod_rows, residual, keep, bias in ((B, True, True, True), (1, True, False, False), (B, False, True, False),
                                           (1, False, False, False)):
        x, r, shift, scale, gate = _inputs(device, dtype, mod_rows, seed=mod_rows)
        args = (r, gate) if residual else (None, None)
        bias_H = (torch.randn(H, generator=torch.Generator().manual_seed(5)) * 0.3).to(device, dtype) if bias else None
        xn, m, q, s = norm_modulate_quantize_rows(x, shift, scale, EPS, *args, keep, bias_H)
        rx, rm, rq, rs = (norm_quantize_reference if rounds else norm_quantize.fused_reference)(
            x, shift, scale, EPS, *args, bias_H)
        assert (xn.numel() > 0) == residual and (m.numel() > 0) == keep
        if residual:
            assert torch.equal(xn, rx) if rounds else torch.testing.assert_close(xn, rx, **tol) is None
        if keep:
            torch.testing.assert_close(m.float(), rm.float(), **tol)
            # each op rounded to the 16-bit dtype as eager rounds it: bit-equal but where the statistics' sums
            # round apart (a GPU kernel that skipped the roundings between the ops left 28 % of a bf16 m one step off;
            # float32's m differs in its last bits with the sums' order)
            assert tight or (m == rm).float().mean() > 0.99
        torch.testing.assert_close(s, rs, rtol=1e-5 if tight else 2 ** -7, atol=0)
        step = (rq.float().abs() * 2.0 ** -3).clamp_min(2.0 ** -9)
        assert ((q.float() - rq.float()).abs() <= step + 1e-6).all()
        assert (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean() > 0.97


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter only")
@pytest.mark.parametrize("launch", LAUNCHES)
def test_kernel_interpreted(launch, monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: the roundings by the kernel's integer arithmetic
        _kernel_vs_reference("cpu", dtype, launch, monkeypatch)


def test_kernel_on_cpu():
    """The kernel's logic (masks, the modulation's strides and broadcast, the optional outputs), alone and inside
    the blocks, in Triton's CPU interpreter; a subprocess, as Triton reads TRITON_INTERPRET when it decorates the
    kernel."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_kernel_interpreted", f"{__file__}::test_block_forward_interpreted"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and f"{len(LAUNCHES) + 1} passed" in run.stdout, \
        run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_kernel_on_gpu(dtype, launch, monkeypatch):
    _kernel_vs_reference("cuda", dtype, launch, monkeypatch)


# ---- the Qwen-Image block on the path (CPU: the op's torch ops, the block's own sequence, so bit for bit) ----------

@pytest.fixture
def tiny(single_rank, monkeypatch):
    from model_specs.qwen_image.model import QwenImageModel
    from tests.qwen_image_reference import tiny_config

    monkeypatch.setattr(fp8, "MIN_ROWS", 16)  # the tiny model's GEMMs have 16 x batch image rows, 8 x batch text
    arch = tiny_config()
    torch.manual_seed(0)
    return arch, QwenImageModel(arch, arch.transformer_config(1), single_rank.tp_group)


def _model_inputs(arch, batch=2):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 16, arch.in_channels, generator=g),
            torch.randn(batch, 8, arch.joint_attention_dim, generator=g), torch.full((batch,), 0.5), (1, 4, 4), None)


@TORCH_OPS
@pytest.mark.parametrize("adapters", ["none", "separate", "merged"])
def test_block_hands_its_fp8_gemms_the_one_pass_input(tiny, adapters, monkeypatch):
    """Each block's four adaLN inputs (image / text, before QKV / fc1) come from the op, the modulated activation
    kept only where an unmerged adapter reads it, the attention projections' biases left to the op (their FP8
    products alone: ``fusion.row_parts``) unless an unmerged adapter adds its output there; on a CPU the op's torch
    ops are the block's own, so the forward is bit-equal to the block's plain FP8 path; autograd on, the trainer's
    path."""
    from checkpoints_convert.qwen_image import qwen_image_rules
    from model_specs.common.fusion import fuse_inference
    from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
    from model_specs.common.norm_quantize import enable_adaln_fp8
    from model_specs.common.rollout_linear import enable_fp8, merge_adapters
    from model_specs.qwen_image import layers

    arch, model = tiny
    if adapters != "none":
        apply_lora(model, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(arch), seed=0)
        for m in (mod for mod in model.modules() if hasattr(mod, "lora_B")):
            torch.nn.init.normal_(m.lora_B, std=0.02, generator=torch.Generator().manual_seed(2))
    assert enable_adaln_fp8(model) == 0 and "not on its fused path" in model.blocks[0].adaln_fp8_capable()
    enable_fp8(model)
    if adapters == "merged":
        merge_adapters(model)
    fuse_inference(model)
    with torch.no_grad():
        plain = model(*_model_inputs(arch))
    assert enable_adaln_fp8(model) == len(model.blocks)
    keeps, biases = [], []
    real = layers.norm_modulate_quantize_rows
    monkeypatch.setattr(layers, "norm_modulate_quantize_rows",
                        lambda *a: keeps.append(a[6]) or biases.append(a[7]) or real(*a))
    with torch.no_grad():
        one_pass = model(*_model_inputs(arch))
    assert len(keeps) == 4 * len(model.blocks) and all(k == (adapters == "separate") for k in keeps)
    def deferred(proj):
        return getattr(proj, "base", proj).bias if adapters != "separate" else None

    expected = [e for b in model.blocks for e in (None, None, deferred(b.attention.linear_proj),
                                                  deferred(b.attention.linear_added_proj))]
    assert len(biases) == len(expected) and all(got is want for got, want in zip(biases, expected))
    assert torch.equal(one_pass, plain)
    keeps.clear()
    model(*_model_inputs(arch))  # autograd on: the model dtype's path, no one-pass input
    assert not keeps
    assert enable_adaln_fp8(model, enable=False) == 0 and not any(b.adaln_fp8 for b in model.blocks)


@TORCH_OPS
def test_engine_setting_switches_the_blocks(tiny):
    """``rollout.fp8_adaln_kernel`` through the engine: on only with FP8 and the fusions; the same samples on a CPU."""
    from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request
    from tests.rollout.test_engine import ToyEncoder

    arch, model = tiny
    reqs = [Request(prompt="a red cat", img_fhw=(1, 4, 4), num_steps=4, guidance_scale=4.0, seed=3, window_size=2,
                    window_range=(0, 2), noise_level=1.0)]
    assert EmbeddedEngine(model, arch, ToyEncoder(), EngineConfig(fp8_adaln_kernel=True)).adaln_fp8 == 0
    plain = EmbeddedEngine(model, arch, ToyEncoder(), EngineConfig(fp8=True, fp8_adaln_kernel=False)).generate(reqs)[0]
    assert not any(b.adaln_fp8 for b in model.blocks)
    engine = EmbeddedEngine(model, arch, ToyEncoder(), EngineConfig(fp8=True))  # on by default with FP8
    assert engine.adaln_fp8 == len(model.blocks)
    assert torch.equal(engine.generate(reqs)[0].latents, plain.latents)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter only")
def test_block_forward_interpreted(tiny):
    """The kernel inside the blocks (the modulation's chunk views, both streams, the residual half) against their
    plain FP8 path: the LayerNorm's float32 sums aside, the same codes, so the forwards agree closely."""
    from model_specs.common.fusion import fuse_inference
    from model_specs.common.norm_quantize import enable_adaln_fp8
    from model_specs.common.rollout_linear import enable_fp8

    arch, model = tiny
    enable_fp8(model)
    fuse_inference(model)
    with torch.no_grad():
        plain = model(*_model_inputs(arch))
        assert enable_adaln_fp8(model) == len(model.blocks)
        one_pass = model(*_model_inputs(arch))
    torch.testing.assert_close(one_pass, plain, rtol=1e-4, atol=1e-5)


@TORCH_OPS
def test_block_path_traces_without_graph_breaks(tiny):
    """The path under torch.compile (the product compiles each block): dynamo traces the op and the ``FP8Input``
    handed to the attention and the MLPs into one graph per block (fullgraph), with the eager forward's output."""
    from model_specs.common.fusion import fuse_inference
    from model_specs.common.norm_quantize import enable_adaln_fp8
    from model_specs.common.rollout_linear import enable_fp8

    arch, model = tiny
    enable_fp8(model)
    fuse_inference(model)
    assert enable_adaln_fp8(model) == len(model.blocks)
    with torch.no_grad():
        eager = model(*_model_inputs(arch))
        torch._dynamo.reset()
        for block in model.blocks:
            block.forward = torch.compile(block.forward, backend="aot_eager", fullgraph=True)
        try:
            traced = model(*_model_inputs(arch))
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        finally:
            for block in model.blocks:
                del block.forward
            torch._dynamo.reset()
    assert graphs >= 1 and torch.equal(traced, eager)
