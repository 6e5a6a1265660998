"""A task bundles what a run needs besides the model: its prompts, the text encoder, the image grid
and the decoder from final latents to images the rewards read.

``digits`` (the demo): 16x16 pixel-space digits, no VAE — the 2x2-packed "latents" are the pixels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_omni.data import digits


@dataclass
class Task:
    name: str
    prompts: list[str]
    img_fhw: tuple[int, int, int]
    encode: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]  # prompts -> (emb [N,T,E], mask [N,T])
    decode: Callable[[torch.Tensor], torch.Tensor]  # final latents [N, S_I, C] -> images [N, H, W] in [0, 1]
    text_dim: int
    latent_channels: int


def build_task(name: str, text_max_tokens: int = 16) -> Task:
    if name != "digits":
        raise ValueError(f"unknown task {name!r}; expected 'digits'")
    from megatron_omni.data.text_encoder import MiniLMEncoder

    encoder = MiniLMEncoder(max_tokens=text_max_tokens)
    return Task(name="digits", prompts=[digits.prompt_for(d) for d in range(10)], img_fhw=digits.GRID_FHW,
                encode=encoder.encode, decode=lambda x: digits.to_unit_images(digits.unpack_2x2(x)),
                text_dim=MiniLMEncoder.hidden_size, latent_channels=digits.CHANNELS)
