"""Handwritten digits (scikit-learn's ``load_digits``: 1,797 images of 8x8) as a tiny pixel-space
image task: 16x16 grayscale images in [-1, 1], packed 2x2 into 64 tokens of 4 channels, the layout
Qwen-Image uses for its VAE latents.  Prompts are "a handwritten digit seven"."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from model_specs.common.latents import pack_2x2  # noqa: F401  (the digits are packed as latents)
from model_specs.common.latents import unpack_2x2 as _unpack

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
IMAGE_SIZE = 16
GRID_FHW = (1, IMAGE_SIZE // 2, IMAGE_SIZE // 2)  # token grid of a 2x2-packed 16x16 image
CHANNELS = 4  # 1 gray channel x 2 x 2


def prompt_for(digit: int) -> str:
    return f"a handwritten digit {DIGIT_NAMES[digit]}"


_DIGIT_WORD = re.compile(r"\b(" + "|".join(DIGIT_NAMES) + r")\b", re.IGNORECASE)


def prompt_digit(prompt: str) -> int:
    """The digit a prompt names ("a handwritten digit seven" → 7); exactly one digit name expected."""
    names = {m.lower() for m in _DIGIT_WORD.findall(prompt)}
    if len(names) != 1:
        raise ValueError(f"digit prompt {prompt!r} names {sorted(names) or 'no digit'}; expected exactly one "
                         f"of {DIGIT_NAMES}, e.g. 'a handwritten digit seven'")
    return DIGIT_NAMES.index(names.pop())


def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits upsampled to 16x16 (bilinear), scaled to [-1, 1]: ([N, 1, 16, 16], labels [N])."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return x * 2 - 1, torch.tensor(data.target)


def unpack_2x2(tokens_BIC: torch.Tensor, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE) -> torch.Tensor:
    """model_specs.common.latents.unpack_2x2 at the digits' size."""
    return _unpack(tokens_BIC, height, width)


def to_unit_images(img_B1HW: torch.Tensor) -> torch.Tensor:
    """[-1, 1] model space -> [0, 1] grayscale [B, H, W] (what the digit rewards read)."""
    return ((img_B1HW[:, 0].float() + 1) / 2).clamp(0, 1)
