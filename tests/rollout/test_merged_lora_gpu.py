"""LoRA adapters merged into the rollout's weights on a CUDA GPU (marker ``gpu``; skips itself without one): the
fused inference paths' CUDA kernels in bf16 and, with FP8, ``torch._scaled_mm`` on the row kernel's quantized merged
weights.  Its own module: megatron's parallel state is set up on the GPU here, on the CPU in test_merged_lora.

Run on a GPU machine with ``make test-gpu`` (or ``python -m pytest -m gpu tests``)."""
import pytest
import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.parallel.state import destroy_parallel, init_parallel
from model_specs.common.fusion import fuse_inference
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.common.rollout_linear import enable_fp8, merge_adapters
from model_specs.qwen_image.model import QwenImageModel
from tests.rollout.test_merged_lora import ARCH, _inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def single_gpu():
    state = init_parallel(seed=0, device="cuda")
    yield state
    destroy_parallel()


@pytest.mark.parametrize("fp8_on", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 GEMMs need compute capability 8.9+"))], ids=["bf16", "fp8"])
def test_merged_forward_on_gpu(single_gpu, fp8_on):
    """On a GPU in bf16 (the fused inference paths' CUDA kernels; with FP8 ``torch._scaled_mm`` and the row kernel's
    weight quantization): the merged forward stays within bf16's (FP8's) rounding of the separate one."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = QwenImageModel(ARCH, ARCH.transformer_config(1, params_dtype=torch.bfloat16), single_gpu.tp_group)
    apply_lora(m, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=0)
    m = m.cuda().to(torch.bfloat16).eval()
    for lora in lora_modules(m).values():
        with torch.no_grad():
            lora.lora_B.normal_(std=0.05)
    inputs = [t.cuda().to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in _inputs(batch=16)]  # 256 image rows (FP8 from fp8.MIN_ROWS rows on)
    enable_fp8(m, fp8_on)
    fuse_inference(m)
    with torch.no_grad():
        separate = m(*inputs).float()
    merge_adapters(m)
    fuse_inference(m)
    with torch.no_grad():
        merged = m(*inputs).float()
    rel = float((merged - separate).norm() / separate.norm())
    assert 0 < rel < (3e-2 if fp8_on else 1e-2), rel
