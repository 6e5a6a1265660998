"""Image batches in the formats rewards accept, converted to what a scorer reads.

Rollouts hand rewards either decoded PIL images or one uint8 tensor ``[N, H, W, C]`` (channels last,
the layout PIL, JPEG encoders and OCR engines read); both are converted here once, with an error that
names the bad dtype/shape instead of a failure deep inside PIL.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

_CHANNELS = (1, 3, 4)


def _as_numpy(images: Any) -> np.ndarray:
    if hasattr(images, "detach"):  # torch tensor, possibly on an accelerator
        return images.detach().cpu().numpy()
    return np.asarray(images)


def to_pil_list(images: Any) -> list[Image.Image]:
    """A list of N PIL images from a list of PIL images or a uint8 ``[N, H, W, C]`` tensor/array."""
    if isinstance(images, (list, tuple)) and all(isinstance(im, Image.Image) for im in images):
        return list(images)
    if isinstance(images, (list, tuple)):
        kinds = sorted({type(im).__name__ for im in images})
        raise TypeError(f"got a list of {kinds}; expected a list of PIL.Image or a uint8 [N, H, W, C] tensor")
    array = _as_numpy(images)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] not in _CHANNELS:
        raise TypeError(f"got images of dtype {array.dtype} and shape {tuple(array.shape)}; expected uint8 "
                        f"[N, H, W, C] with C in {_CHANNELS} (channels last, 0..255) or a list of PIL.Image")
    # PIL infers L / RGB / RGBA from a uint8 [H, W] / [H, W, 3] / [H, W, 4] array
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in array]
