"""The fused inference MLP (fc1 bias + GELU-tanh in the GEMM epilogue, a LoRA adapter on fc1 folded into
that GEMM along K) computes what megatron-core's MLP computes; training is untouched."""
import functools

import pytest
import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from model_specs.common.gelu_mlp import GeluMLP, fuse_inference, linear_gelu_tanh, refresh_fused
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel
from model_specs.qwen_image.spec import qwen_image_block_spec

ARCH = tiny_config(num_layers=2)
FHW = (1, 4, 4)


def _model(state, lora: bool, dtype=torch.float32, device="cpu", **config):
    torch.manual_seed(0)
    model = QwenImageModel(ARCH, ARCH.transformer_config(1, params_dtype=dtype, **config), state.tp_group,
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


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_fused_equals_megatron_mlp(single_rank, lora):
    model = _model(single_rank, lora)
    img, txt, sigma = _inputs()
    expected = _forward(model, img, txt, sigma)
    assert fuse_inference(model) == 2 * ARCH.num_layers  # img_mlp and txt_mlp of every block
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


def test_unfusable_mlp_keeps_megatrons_path_or_raises(single_rank):
    model = _model(single_rank, False, activation_func=torch.nn.functional.silu)
    img, txt, sigma = _inputs()
    expected = _forward(model, img, txt, sigma)
    assert fuse_inference(model) == 0
    assert torch.equal(_forward(model, img, txt, sigma), expected)
    with pytest.raises(ValueError, match=r"blocks\.0\.img_mlp cannot take the fused GELU path: activation .*silu"):
        fuse_inference(model, strict=True)


def test_engine_fuses_by_default(single_rank):
    from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig

    model = _model(single_rank, True)
    assert EmbeddedEngine(model, ARCH).fused_mlps == 2 * ARCH.num_layers
    assert EmbeddedEngine(_model(single_rank, True), ARCH, config=EngineConfig(fuse_gelu=False)).fused_mlps == 0


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
