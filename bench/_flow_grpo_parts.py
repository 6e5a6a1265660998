"""Shared pieces of ``bench/flow_grpo_step.py``: the recipe, per-phase timing and FLOPs, and the end-to-end
extras around the DiT (a Qwen2.5-VL-shaped text encoder, the Qwen-Image VAE decoder, the JPEG reward).

Shape legend: N samples of a step (group x prompts); I image tokens; C packed latent channels (64);
T text tokens of a prompt; E text width (3584); H, W image pixels.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
import zlib
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from megatron_omni.rewards import AsyncRewardPool, build_reward
from megatron_omni.trainer.mfu import forward_flops, lora_forward_flops, varlen_step_flops
from model_specs.common.lora import FLOW_GRPO_TARGETS
from model_specs.qwen_image.config import QwenImageConfig, tiny_config

NEGATIVE = " "  # QwenImagePipeline's default negative prompt
REWARD = "jpeg_compressibility"  # no OCR engine on the GPU machine; a real rule reward that needs no weights


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
    micro_batch: int = 4  # (sample, step) pairs per training forward of ours
    reference_micro_batch: int = 4  # the peer loop's, as docs/benchmarks.md measured it
    # ours: the one optimizer step per RL step reuses the rollout's uncond outputs (weights unchanged since)
    reuse_uncond: bool = True
    lora_rank: int = 64
    lora_alpha: float = 128.0
    lr: float = 3e-4
    clip_range: float = 1e-5
    text_layers: int = 28  # of the text encoder (Qwen2.5-VL-7B has 28)
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
    """Full size on the GPU (bf16), or the tiny test model on the CPU (float32) with ``smoke``."""
    if smoke:
        return Recipe(arch=tiny_config(num_layers=2), device=torch.device("cpu"), dtype=torch.float32,
                      img_fhw=(1, 4, 4), text_tokens=16, text_layers=2, smoke=True, **overrides)
    if not torch.cuda.is_available():
        raise SystemExit("bench/flow_grpo_step.py: no CUDA device; the full-size run needs one (use --smoke on a CPU)")
    device = torch.device("cuda", torch.cuda.current_device())
    return Recipe(arch=QwenImageConfig(), device=device, dtype=torch.bfloat16, **overrides)


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


def phase_flops(recipe: Recipe, reused_uncond: bool = False, adapters: bool = True) -> dict[str, float]:
    """DiT FLOPs of one step by phase (megatron_omni.trainer.mfu, the LoRA adapters' FLOPs included; with
    ``adapters=False`` the base model's alone, as this bench counted before 2026-12-01), each row at its text
    length (the negative prompt's may differ).  ``reused_uncond``: the loop trained on the rollout's uncond
    outputs, so no uncond forward ran in 'train'."""
    def per_row(n: int) -> tuple[float, float]:
        adapter = lora_forward_flops(recipe.arch, recipe.lora_rank, FLOW_GRPO_TARGETS, 1, recipe.image_tokens, n)
        return forward_flops(recipe.arch, 1, recipe.image_tokens, n), adapter if adapters else 0.0

    uncond = recipe.uncond_tokens if recipe.guidance > 1 else None
    pairs = recipe.samples * recipe.window
    count = partial(varlen_step_flops, per_row, frozen_base=True)
    return {"rollout": count([(recipe.text_tokens, uncond, 0)] * recipe.samples, rollout_steps=recipe.num_steps),
            "train": count([(recipe.text_tokens, uncond, recipe.window)] * recipe.samples, rollout_steps=0,
                           reused_uncond_pairs=pairs if reused_uncond else 0)}


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


# ---- end-to-end extras ----------------------------------------------------------------------------------

TEMPLATE_TOKENS = 34  # QwenImagePipeline drops the hidden states of its prompt template's 34 tokens


def encode_step(text: "TextEncoder", recipe: Recipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the prompts' embeddings [P, T, E], the negative prompt's [T_neg, E]): one encoder call when both have
    one length, else two."""
    if recipe.uncond_tokens == recipe.text_tokens:
        emb_NTE = text.encode(prompts + [NEGATIVE])
        return emb_NTE[:-1], emb_NTE[-1]
    return text.encode(prompts), text.encode([NEGATIVE], recipe.uncond_tokens)[0]


class TextEncoder:
    """Qwen-Image's text encoder at its shape, random init: transformers' Qwen2.5-VL text model with
    Qwen2.5-VL-7B's language-model config (hidden 3584, 28 layers, 28 query / 4 KV heads, MLP 18944, vocab
    152064).  No tokenizer ships offline, so a prompt becomes 34 + T token ids drawn from its text (the
    template's tokens and T prompt tokens); the template's hidden states are dropped as the pipeline does."""

    def __init__(self, recipe: Recipe):
        from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

        if recipe.smoke:
            shape = dict(hidden_size=recipe.arch.joint_attention_dim, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, mrope_section=[2, 3, 3])
        else:
            shape = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                         vocab_size=152064, mrope_section=[16, 24, 24])
        if shape["hidden_size"] != recipe.arch.joint_attention_dim:
            raise ValueError(f"text encoder width {shape['hidden_size']} != the DiT's joint_attention_dim "
                             f"{recipe.arch.joint_attention_dim}")
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": shape.pop("mrope_section")}
        config = Qwen2_5_VLTextConfig(**shape, num_hidden_layers=recipe.text_layers, rms_norm_eps=1e-6,
                                      bos_token_id=None, eos_token_id=None, rope_parameters=rope)
        with torch.device(recipe.device):  # random init straight on the device, in the model dtype
            self.model = Qwen2_5_VLTextModel._from_config(config, dtype=recipe.dtype).eval().requires_grad_(False)
        self.recipe, self.vocab = recipe, config.vocab_size
        self.params = sum(p.numel() for p in self.model.parameters())

    def describe(self) -> str:
        r = self.recipe
        full = " (Qwen2.5-VL-7B's language model)" if r.text_layers == 28 and not r.smoke else ""
        negative = f" ({r.uncond_tokens} for the negative prompt)" if r.uncond_tokens != r.text_tokens else ""
        return (f"text encoder: transformers Qwen2_5_VLTextModel, random init, {r.text_layers} layers, "
                f"{self.params / 1e9:.2f} B params{full}, {TEMPLATE_TOKENS} template + {r.text_tokens} "
                f"prompt tokens per prompt{negative}")

    @torch.no_grad()
    def encode(self, prompts: list[str], tokens: int | None = None) -> torch.Tensor:
        """[N, T, E] last hidden states of the prompt tokens (T = ``tokens``, default the recipe's), model dtype."""
        tokens = self.recipe.text_tokens if tokens is None else tokens
        ids = torch.stack([torch.randint(0, self.vocab, (TEMPLATE_TOKENS + tokens,),
                                         generator=torch.Generator().manual_seed(zlib.crc32(p.encode())))
                           for p in prompts]).to(self.recipe.device)
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state
        return out[:, TEMPLATE_TOKENS:]


class Decoder:
    """diffusers ``AutoencoderKLQwenImage`` at its default (= Qwen-Image's) config, random init: packed latents
    -> uint8 images, unpacked and de-normalised exactly as ``QwenImagePipeline`` does before ``vae.decode``."""

    def __init__(self, recipe: Recipe):
        from diffusers import AutoencoderKLQwenImage

        kwargs = dict(base_dim=32, dim_mult=[1, 2, 2, 2], num_res_blocks=1) if recipe.smoke else {}
        with torch.device(recipe.device), default_dtype(recipe.dtype):
            self.vae = AutoencoderKLQwenImage(**kwargs).eval().requires_grad_(False)
        z = self.vae.config.z_dim
        self.mean = torch.tensor(self.vae.config.latents_mean, device=recipe.device).view(1, z, 1, 1, 1)
        self.std = torch.tensor(self.vae.config.latents_std, device=recipe.device).view(1, z, 1, 1, 1)
        self.recipe = recipe
        self.params = sum(p.numel() for p in self.vae.parameters())

    def describe(self) -> str:
        size = "" if self.recipe.smoke else " (Qwen-Image's VAE config)"
        return f"VAE: diffusers AutoencoderKLQwenImage, random init, {self.params / 1e6:.0f} M params{size}"

    @torch.no_grad()
    def __call__(self, latents_NIC: torch.Tensor) -> torch.Tensor:
        """[N, I, C] packed latents at t = 0 -> uint8 [N, H, W, 3] on the CPU."""
        n, _, c = latents_NIC.shape
        _, h, w = self.recipe.img_fhw
        z_NZ1hw = (latents_NIC.view(n, h, w, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
                   .reshape(n, c // 4, 1, 2 * h, 2 * w))
        z_NZ1hw = (z_NZ1hw.float() * self.std + self.mean).to(self.recipe.dtype)
        image_N3HW = self.vae.decode(z_NZ1hw, return_dict=False)[0][:, :, 0]
        pixels = ((image_N3HW.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu()


class Reward:
    """The JPEG-compressibility reward (megatron_omni.rewards), scored in a pool of CPU threads."""

    def __init__(self):
        workers = min(8, os.cpu_count() or 1)
        self.pool = AsyncRewardPool({REWARD: build_reward(REWARD)}, num_workers=workers, chunk_size=2)
        self.workers = workers

    def describe(self) -> str:
        return (f"reward: {REWARD} (megatron_omni.rewards: -JPEG kB at quality 95) in {self.workers} CPU threads; "
                f"tesseract (OCR) is not installed on the GPU machine")

    def __call__(self, images_NHW3: torch.Tensor, prompts: list[str]) -> np.ndarray:
        return self.pool.submit(images_NHW3, prompts).result()[REWARD]

    def close(self) -> None:
        self.pool.close()


@dataclass
class EndToEnd:
    text: TextEncoder
    decode: Decoder
    reward: Reward

    @classmethod
    def build(cls, recipe: Recipe) -> "EndToEnd":
        return cls(TextEncoder(recipe), Decoder(recipe), Reward())

    def describe(self) -> list[str]:
        return [self.text.describe(), self.decode.describe(), self.reward.describe()]
