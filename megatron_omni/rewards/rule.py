"""Rule rewards that need no model: JPEG (in)compressibility, the DDPO / Flow-GRPO sanity tasks.

Definition (ddpo-pytorch and flow_grpo ``rewards.py``): encode each image as JPEG at quality 95 with
PIL and measure the file size in kB (bytes / 1000).  ``jpeg_incompressibility`` = +size (busy,
detailed images win); ``jpeg_compressibility`` = −size (flat, smooth images win).  flow_grpo further
divides the compressibility by 500; group-normalised advantages are invariant to a positive scale, so
only logged values differ — pass ``scale=1/500`` to reproduce its numbers.
"""
from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np

from megatron_omni.rewards.images import to_pil_list
from megatron_omni.rewards.registry import register_reward


def jpeg_size_kb(images: Any, quality: int = 95) -> np.ndarray:
    """Size in kB of each image encoded as JPEG at ``quality`` (RGBA/other modes are encoded as RGB)."""
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality {quality}: expected an integer in 1..100")
    sizes = []
    for image in to_pil_list(images):
        buffer = io.BytesIO()
        image.convert("RGB" if image.mode not in ("L", "RGB") else image.mode).save(
            buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return np.asarray(sizes, dtype=np.float64)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility:
    """+JPEG size in kB: rewards detail (and noise)."""

    def __init__(self, quality: int = 95, scale: float = 1.0):
        self.quality, self.scale = quality, scale

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> np.ndarray:
        return self.scale * jpeg_size_kb(images, self.quality)


@register_reward("jpeg_compressibility")
class JpegCompressibility(JpegIncompressibility):
    """−JPEG size in kB: rewards flat, smooth images."""

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> np.ndarray:
        return -super().__call__(images, prompts, metadata)
