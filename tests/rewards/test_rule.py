"""JPEG (in)compressibility: a flat image is more compressible than noise; PIL lists and uint8 tensors
score alike; compressibility is exactly the negated size in kB."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omni.rewards import build_reward


def _flat_and_noise() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    flat = torch.full((64, 64, 3), 128, dtype=torch.uint8)
    noise = torch.randint(0, 256, (64, 64, 3), generator=g, dtype=torch.uint8)
    return torch.stack([flat, noise])  # uint8 [2, 64, 64, 3]


def test_flat_is_more_compressible_than_noise(report):
    images, prompts = _flat_and_noise(), ["flat", "noise"]
    compress = build_reward("jpeg_compressibility")(images, prompts, None)
    incompress = build_reward("jpeg_incompressibility")(images, prompts, None)
    report(f"64x64 JPEG q95 size: flat {incompress[0]:.2f} kB, noise {incompress[1]:.2f} kB")
    assert compress[0] > compress[1] and incompress[1] > incompress[0]
    np.testing.assert_array_equal(compress, -incompress)


def test_size_is_kilobytes_at_quality_95_and_formats_agree():
    images = _flat_and_noise()
    pil = [Image.fromarray(a) for a in images.numpy()]
    buffer = io.BytesIO()
    pil[1].save(buffer, format="JPEG", quality=95)
    sizes = build_reward("jpeg_incompressibility")(pil, ["a", "b"], None)
    assert sizes[1] == buffer.tell() / 1000
    np.testing.assert_array_equal(sizes, build_reward("jpeg_incompressibility")(images, ["a", "b"], None))
    np.testing.assert_allclose(build_reward("jpeg_compressibility", scale=1 / 500)(images, ["a", "b"], None),
                               -sizes / 500)  # flow_grpo's scaling


def test_bad_image_batches_are_named():
    reward = build_reward("jpeg_compressibility")
    with pytest.raises(TypeError, match=r"dtype float32 and shape \(2, 3, 8, 8\); expected uint8 \[N, H, W, C\]"):
        reward(torch.zeros(2, 3, 8, 8), ["a", "b"], None)
    with pytest.raises(ValueError, match="quality 0: expected an integer in 1..100"):
        build_reward("jpeg_compressibility", quality=0)(_flat_and_noise(), ["a", "b"], None)
