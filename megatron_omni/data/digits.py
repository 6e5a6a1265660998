"""Handwritten digits (scikit-learn's ``load_digits``: 1,797 images of 8x8) as a tiny pixel-space
image task: 16x16 grayscale images in [-1, 1], packed 2x2 into 64 tokens of 4 channels, the layout
Qwen-Image uses for its VAE latents.  Prompts are "a handwritten digit seven"."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

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


def pack_2x2(img_B1HW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C], the order diffusers' Qwen-Image pipeline packs latents in."""
    b, c, h, w = img_B1HW.shape
    x = img_B1HW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens_BIC: torch.Tensor, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE) -> torch.Tensor:
    """Inverse of :func:`pack_2x2`."""
    b, _, c4 = tokens_BIC.shape
    c = c4 // 4
    x = tokens_BIC.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def to_unit_images(img_B1HW: torch.Tensor) -> torch.Tensor:
    """[-1, 1] model space -> [0, 1] grayscale [B, H, W] (what the digit rewards read)."""
    return ((img_B1HW[:, 0].float() + 1) / 2).clamp(0, 1)
