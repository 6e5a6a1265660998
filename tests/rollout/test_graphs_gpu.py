"""A rollout batch's forwards replayed as CUDA graphs (``rollout.cuda_graphs``; marker ``gpu``, skips itself without
one): the same trajectories, bit for bit, as the forwards launched one by one -- eager, FP8, and under torch.compile
-- with the model's Python forward run only at each layout's first two steps (the run, then the capture).

Run on a GPU machine with ``make test-gpu`` (or ``python -m pytest -m gpu tests``)."""
from dataclasses import replace

import pytest
import torch

from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request
from model_specs.qwen_image.model import QwenImageModel
from tests.rollout.test_engine import ARCH, ToyEncoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module")
def single_gpu():
    state = init_parallel(seed=0, device="cuda")
    yield state
    destroy_parallel()


def _requests(steps: int):
    # 16 x 16 image tokens (FP8 from fp8.MIN_ROWS rows on); two prompts of one length (one batch), whose negative prompt
    # has another, so the CFG batch runs two forward layouts (two graphs sharing one pool)
    common = dict(img_fhw=(1, 16, 16), num_steps=steps, shift=2.0, noise_level=1.2, guidance_scale=4.0,
                  window_size=2, window_range=(0, 2), keep_uncond_velocity=True)
    return [Request(prompt=p, prompt_id=i, seed=100 + i, **common)
            for i, p in enumerate(["a red cat on a mat", "two dogs by the sea now"])] \
        + [replace(Request(prompt="a blue house", prompt_id=2, seed=9, **common), guidance_scale=1.0)]  # no CFG


@pytest.mark.parametrize("mode", ["eager", pytest.param("fp8", marks=pytest.mark.skipif(
    not FP8_GPU, reason="FP8 GEMMs need compute capability 8.9+")), "compiled"])
def test_graphed_rollout_is_bit_equal_to_launched_one(single_gpu, mode):
    from megatron_omni.compile import compile_blocks

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = QwenImageModel(ARCH, ARCH.transformer_config(1, params_dtype=torch.bfloat16), single_gpu.tp_group)
    model = model.to(torch.bfloat16)
    torch._dynamo.reset()
    if mode == "compiled":
        compile_blocks(model, "default")
    calls = []
    handle = model.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    steps, runs = 5, {}
    try:
        for graphs in (False, True):
            calls.clear()
            engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(fp8=mode == "fp8", cuda_graphs=graphs))
            runs[graphs] = engine.generate(_requests(steps))
            # batches: the two CFG requests (2 layouts: prompt, negative prompt), the request without CFG (1)
            assert len(calls) == (3 * 2 if graphs else 3 * steps), calls
    finally:
        handle.remove()
        torch._dynamo.reset()
    for a, b in zip(runs[False], runs[True]):
        for name in ("latents", "log_probs", "trained", "uncond_velocity"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (mode, name)
    assert runs[True][0].uncond_velocity is not None and not torch.equal(runs[True][0].uncond_velocity[0],
                                                                         runs[True][0].uncond_velocity[1])
