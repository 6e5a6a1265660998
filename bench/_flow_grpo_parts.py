"""Shared pieces of the peer loop (``bench/_flow_grpo_reference.py``, run beside the product's loop by
``bench/flow_grpo_step.py``) and ``bench/train_step.py``: the recipe's shape, per-phase timing and the DiT FLOPs.

Shape legend: N samples of a step (group x prompts); I image tokens; C packed latent channels (64);
T text tokens of a prompt; E text width (3584).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from megatron_omni.trainer.mfu import forward_flops, lora_forward_flops, varlen_step_flops
from model_specs.common.lora import FLOW_GRPO_TARGETS
from model_specs.qwen_image.config import QwenImageConfig, tiny_config

@dataclass
class Recipe:
    """The VeRL-Omni Qwen-Image FlowGRPO OCR recipe's shape (docs/algorithms.md, docs/benchmarks.md)."""

    arch: QwenImageConfig
    device: torch.device
    dtype: torch.dtype
    img_fhw: tuple[int, int, int] = (1, 32, 32)  # 512 px / 8 (VAE) / 2 (2x2 packing): 1024 image tokens
    text_tokens: int = 128  # per prompt, no padding (docs/benchmarks.md's 1024 + 128 tokens)
    negative_tokens: int | None = None  # the negative prompt's; None = text_tokens (docs/benchmarks.md's shape)
    num_steps: int = 10
    shift: float = 1.714  # e^mu with Qwen-Image's dynamic-shift mu = 0.539 at 1024 image tokens, as a static shift
    guidance: float = 4.0  # true CFG, Qwen-Image's per-token norm rescale
    noise_level: float = 1.2
    window: int = 2  # trained SDE steps per sample
    window_starts: tuple[int, int] = (0, 3)  # inclusive: the window lies in steps 0..4 (sde_window_range (0, 5))
    group: int = 16
    prompts: int = 1
    rollout_batch: int = 16  # samples per rollout forward: 32 rows with CFG
    micro_batch: int = 4  # (sample, step) pairs per training forward (bench/train_step.py)
    reference_micro_batch: int = 4  # the peer loop's, as docs/benchmarks.md measured it
    lora_rank: int = 64
    lora_alpha: float = 128.0
    lr: float = 3e-4
    clip_range: float = 1e-5
    smoke: bool = False

    @property
    def samples(self) -> int:
        return self.group * self.prompts

    @property
    def uncond_tokens(self) -> int:
        return self.text_tokens if self.negative_tokens is None else self.negative_tokens

    @property
    def image_tokens(self) -> int:
        return self.img_fhw[0] * self.img_fhw[1] * self.img_fhw[2]

    @property
    def autocast(self):
        """bf16 autocast for the reference loop (accelerate's mixed precision, as flow_grpo trains)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)


def make_recipe(smoke: bool, **overrides) -> Recipe:
    """Full size on the GPU (bf16), or the tiny test model on the CPU (float32) with ``smoke``; ``overrides``
    replace fields (``arch``, ``img_fhw``, ``text_tokens``: the shape the product's loop ran)."""
    if smoke:
        base = dict(arch=tiny_config(num_layers=2), device=torch.device("cpu"), dtype=torch.float32, img_fhw=(1, 4, 4),
                    text_tokens=16, smoke=True)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench: no CUDA device; the full-size run needs one (use --smoke on a CPU)")
        base = dict(arch=QwenImageConfig(), device=torch.device("cuda", torch.cuda.current_device()),
                    dtype=torch.bfloat16)
    return Recipe(**{**base, **overrides})


# ---- time and FLOPs ---------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class PhaseTimer:
    """Seconds per named phase of one step, the device synchronised at both ends of each."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the timed steps (sums of phases are summed per step first)."""
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]}


def phase_flops(recipe: Recipe, adapters: bool = True) -> dict[str, float]:
    """DiT FLOPs of one step of the peer loop by phase (megatron_omni.trainer.mfu, the LoRA adapters' FLOPs
    included; with ``adapters=False`` the base model's alone), each row at its text length (the negative prompt's
    may differ); training recomputes the uncond rows (no reuse)."""
    def per_row(n: int) -> tuple[float, float]:
        adapter = lora_forward_flops(recipe.arch, recipe.lora_rank, FLOW_GRPO_TARGETS, 1, recipe.image_tokens, n)
        return forward_flops(recipe.arch, 1, recipe.image_tokens, n), adapter if adapters else 0.0

    uncond = recipe.uncond_tokens if recipe.guidance > 1 else None
    count = partial(varlen_step_flops, per_row, frozen_base=True)
    return {"rollout": count([(recipe.text_tokens, uncond, 0)] * recipe.samples, rollout_steps=recipe.num_steps),
            "train": count([(recipe.text_tokens, uncond, recipe.window)] * recipe.samples, rollout_steps=0)}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules straight in ``dtype`` (diffusers warns about ``.to(dtype)`` after the fact)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    import gc

    torch._dynamo.reset()  # compiled graphs keep guards on the modules they saw
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
