"""The rollout engine's inference fusions compute what the plain model computes; training is untouched.
The fused MLP (fc1 bias + GELU-tanh in the GEMM epilogue, a LoRA adapter on fc1 folded into that GEMM
along K) and the joint q / k norm + RoPE + layout op (a Triton kernel on CUDA, torch ops elsewhere: the
CPU tests check the model's plumbing around it, the ``gpu`` tests the kernel)."""
import functools
import os
import subprocess
import sys

import pytest
import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from model_specs.common.fusion import fuse_inference, refresh_fused
from model_specs.common.gelu_mlp import GeluMLP, linear_gelu_tanh
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec

ARCH = tiny_config(num_layers=2)
FHW = (1, 4, 4)


def _model(state, lora: bool, dtype=torch.float32, device="cpu", **config):
    torch.manual_seed(0)
    tp = state.tp_group.size()
    model = QwenImageModel(ARCH, ARCH.transformer_config(tp, params_dtype=dtype, **config), state.tp_group,
                           qwen_image_block_spec("local")).to(device)
    if lora:
        apply_lora(model, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=0)
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=0.05)  # nonzero B: the adapters change the output
    return model.eval()


def _inputs(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1)
    img = torch.randn(3, 16, ARCH.in_channels, generator=g).to(device, dtype)
    txt = torch.randn(3, 8, ARCH.joint_attention_dim, generator=g).to(device, dtype)
    return img, txt, torch.tensor([0.2, 0.5, 0.9], device=device)


def _forward(model, img, txt, sigma):
    with torch.no_grad():
        return model(img, txt, sigma, FHW, None)


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_fused_equals_megatron_mlp(single_rank, lora):
    model = _model(single_rank, lora)
    img, txt, sigma = _inputs()
    expected = _forward(model, img, txt, sigma)
    assert fuse_inference(model) == 3 * ARCH.num_layers  # img_mlp, txt_mlp and the attention of every block
    assert all(m.fused and (m.fused_weight is not None) == lora for m in model.modules() if isinstance(m, GeluMLP))
    torch.testing.assert_close(_forward(model, img, txt, sigma), expected, rtol=1e-5, atol=1e-6)
    if lora:  # new adapter weights (a sync): stale until refreshed, then equal to megatron's path again
        for m in lora_modules(model).values():
            m.lora_B.data.mul_(-1.5)
        fuse_inference(model, enable=False)
        expected = _forward(model, img, txt, sigma)
        fuse_inference(model)
        for m in lora_modules(model).values():
            m.lora_B.data.mul_(2.0)
        stale = _forward(model, img, txt, sigma)
        refresh_fused(model)
        fresh = _forward(model, img, txt, sigma)
        fuse_inference(model, enable=False)
        torch.testing.assert_close(fresh, _forward(model, img, txt, sigma), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(stale, fresh, rtol=1e-3, atol=1e-4)
        del expected


def test_training_keeps_megatrons_path(single_rank):
    """With autograd on the fused flag changes nothing: the adapters of fc1 get their gradients."""
    model, fused = _model(single_rank, True), _model(single_rank, True)
    fuse_inference(fused)
    img, txt, sigma = _inputs()
    grads = []
    for m in (model, fused):
        m(img, txt, sigma, FHW, None).square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    fc1 = [n for n in grads[0] if "img_mlp.linear_fc1" in n]  # (the last block's text stream feeds nothing)
    assert len(fc1) == 2 * ARCH.num_layers and all(grads[1][n] is not None and grads[1][n].abs().sum() > 0 for n in fc1)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.numerics
def test_unfusable_mlp_keeps_megatrons_path_or_raises(single_rank):
    model = _model(single_rank, False, activation_func=torch.nn.functional.silu)
    img, txt, sigma = _inputs()
    expected = _forward(model, img, txt, sigma)
    assert fuse_inference(model) == ARCH.num_layers  # the attentions only
    assert not any(m.fused for m in model.modules() if isinstance(m, GeluMLP))
    torch.testing.assert_close(_forward(model, img, txt, sigma), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"blocks\.0\.img_mlp \(GeluMLP\) cannot take its fused path: activation .*silu"):
        fuse_inference(model, strict=True)


def _tp2_fused_vs_plain(state):
    """On each TP rank: the plain and the fused forward of the same TP=2 shards (LoRA on), with a padded text mask."""
    model = _model(state, True)
    img, txt, sigma = _inputs()
    mask = torch.tensor([[True] * 8, [True] * 5 + [False] * 3, [True] * 8])
    with torch.no_grad():
        plain = model(img, txt, sigma, FHW, mask)
        fused_count = fuse_inference(model)
        fused = model(img, txt, sigma, FHW, mask)
    return fused_count, ((fused - plain).norm() / plain.norm()).item()


@pytest.mark.numerics
def test_fused_equals_plain_at_tp2():
    """Column-parallel fc1 / QKV shards (heads split over TP) and the row-parallel all-reduce after them."""
    from megatron_omni.parallel.testing import run_distributed

    for count, err in run_distributed(_tp2_fused_vs_plain, 2, parallel={"tp": 2}):
        assert count == 3 * ARCH.num_layers and err < 1e-6, (count, err)


def test_engine_fuses_by_default(single_rank):
    from megatron_omni.config import load_config
    from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig

    assert load_config().rollout.fuse and not load_config(overrides=["rollout.fuse=false"]).rollout.fuse

    model = _model(single_rank, True)
    assert EmbeddedEngine(model, ARCH).fused == 3 * ARCH.num_layers
    assert EmbeddedEngine(_model(single_rank, True), ARCH, config=EngineConfig(fuse=False)).fused == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cublaslt_epilogue_is_gelu_tanh():
    """cuBLASLt's GELU epilogue is the tanh form the model uses: float32 within 1e-5, bf16 within bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = (torch.randn(*s, device="cuda", generator=g) for s in ((512, 256), (1024, 256), (1024,)))
    gelu = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    torch.testing.assert_close(linear_gelu_tanh(x, w, b), gelu(torch.addmm(b, x, w.t())), rtol=1e-5, atol=1e-5)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    fused = linear_gelu_tanh(xb, wb, bb).float()
    exact = gelu(torch.addmm(bb.float(), xb.float(), wb.float().t()))
    assert (fused - exact).norm() / exact.norm() < 4e-3


def _kernel_vs_torch_ops(device: str, dtypes, heads: int, head_dim: int, added: bool):
    """The Triton kernel against the torch ops (the unfused model's math): float32 within 1e-5, bf16 within
    one rounding; odd lengths, heads not a multiple of the kernel's head block, a strided (sliced) input.
    With a bias and a LoRA output to add: v (no norm after the sum) equals the float32 sum rounded once, bit
    for bit, as the separate fused add computed it."""
    from model_specs.qwen_image.conditioning import rope_freqs
    from model_specs.common.qk_norm_rope import _reference, joint_qk_norm_rope

    g = torch.Generator(device=device).manual_seed(0)
    width, b = 3 * heads * head_dim, 3
    img_freqs, txt_freqs = rope_freqs((1, 6, 5), 7, (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16), 10000,
                                      device)
    for dtype, tol in dtypes:
        qkv_t = torch.randn(7, b, width, device=device, generator=g).to(dtype)
        qkv_i = torch.randn(30, b, width + 16, device=device, generator=g).to(dtype)[..., :width]  # strided rows
        w = [(1 + 0.1 * torch.randn(head_dim, device=device, generator=g)).to(dtype) for _ in range(4)]
        txt, img = (qkv_t, w[0], w[1], txt_freqs), (qkv_i, w[2], w[3], img_freqs)
        if added:
            bias_t, bias_i = (torch.randn(width, device=device, generator=g).to(dtype) for _ in range(2))
            lora_i = (0.1 * torch.randn(30, b, width + 8, device=device, generator=g)).to(dtype)[..., :width]
            txt, img = txt + (bias_t, None), img + (bias_i, lora_i)  # text: a bias only; image: strided LoRA
        got = joint_qk_norm_rope(txt, img, heads=heads, eps=1e-6)
        want = _reference((txt, img), heads, 1e-6)
        for name, a, e in zip("qkv", got, want):
            assert a.shape == (37, b, heads, head_dim) and a.is_contiguous(), name  # Megatron's [S, B, N, D]
            err = ((a.float() - e.float()).norm() / e.float().norm()).item()
            assert err < tol, (name, dtype, err)
        if not added:  # v is the input's own slice: text rows first, then image, per head [q_h, k_h, v_h]
            v_of = lambda qkv: qkv.reshape(*qkv.shape[:2], heads, 3, head_dim)[..., 2, :]  # noqa: E731
            assert torch.equal(got[2], torch.cat([v_of(qkv_t), v_of(qkv_i)]))
        if added:
            assert torch.equal(got[2], want[2]), "v: the sum rounded differently"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("added", [False, True], ids=["qkv", "qkv+bias+lora"])
@pytest.mark.parametrize("heads,head_dim", [(12, 64), (24, 128)])
def test_joint_qk_norm_rope_kernel_equals_torch_ops(heads, head_dim, added):
    _kernel_vs_torch_ops("cuda", ((torch.float32, 1e-5), (torch.bfloat16, 4e-3)), heads, head_dim, added)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter only")
def test_joint_qk_norm_rope_kernel_interpreted():
    for added in (False, True):
        _kernel_vs_torch_ops("cpu", ((torch.float32, 1e-5),), 3, 32, added)


def test_joint_qk_norm_rope_kernel_on_cpu():
    """The kernel's logic (head blocks, masks, strides, the joint layout, the added bias and LoRA output) in
    Triton's CPU interpreter, float32: the CI machine has no GPU.  A subprocess: Triton reads TRITON_INTERPRET
    when it decorates the kernel."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    test = f"{__file__}::test_joint_qk_norm_rope_kernel_interpreted"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
