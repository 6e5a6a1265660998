"""Digit rewards for the pixel-space demo: the probability a classifier gives the digit the prompt names.

Prompts name one digit by word: "a handwritten digit seven" (zero … nine).  Two rewards:

- ``digit_classifier``: the training reward, a small CNN (see :mod:`.digit_models`);
- ``digit_judge``: a held-out SVC of another family, trained on other images.  Log it beside the
  reward: when the reward keeps rising and the judge stalls, the policy is hacking the reward.

Expected images (what :func:`megatron_omni.data.digits.to_unit_images` returns): grayscale, **ink
bright (1) on a dark background (0)** like ``load_digits``, 16×16 or 8×8 (8×8 is upsampled bilinearly
to 16×16, the way the training data was made), as

- float ``[N, H, W]`` or ``[N, 1, H, W]`` in [0, 1] (torch or numpy; values a hair outside are
  clamped, anything beyond ±1e-3 is an error — usually [-1, 1] model-space images passed by mistake);
- uint8 ``[N, H, W, C]`` or a list of PIL images (0..255; RGB is averaged to gray).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from megatron_omni.rewards.digit_models import (IMAGE_SIZE, load_or_train_cnn, load_or_train_judge,
                                                pool_to_8x8)
from megatron_omni.rewards.images import to_pil_list
from megatron_omni.data.digits import prompt_digit
from megatron_omni.rewards.registry import register_reward

_RANGE_TOLERANCE = 1e-3  # images may overshoot [0, 1] by this much (interpolation) before it is an error

def to_digit_images(images: Any) -> torch.Tensor:
    """Any accepted image batch → float32 [N, 16, 16] in [0, 1], ink bright (see the module docstring)."""
    if isinstance(images, (list, tuple)):
        images = torch.stack([torch.from_numpy(np.asarray(im.convert("L"), dtype=np.float32) / 255.0)
                              for im in to_pil_list(images)])
    x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.asarray(images))
    if x.dtype == torch.uint8:
        if x.ndim != 4:
            raise ValueError(f"uint8 digit images of shape {tuple(x.shape)}; expected [N, H, W, C]")
        x = x.float().mean(dim=-1) / 255.0  # channels last → gray
    elif x.is_floating_point():
        x = x.float()
        if x.ndim == 4 and x.shape[1] == 1:
            x = x[:, 0]
        lo, hi = (x.min().item(), x.max().item()) if x.numel() else (0.0, 0.0)
        if lo < -_RANGE_TOLERANCE or hi > 1 + _RANGE_TOLERANCE:
            raise ValueError(f"digit images range over [{lo:.3g}, {hi:.3g}]; expected [0, 1] (ink = 1) — "
                             f"model-space [-1, 1] images need (x + 1) / 2 first")
        x = x.clamp(0, 1)
    else:
        raise TypeError(f"digit images of dtype {x.dtype}; expected float in [0, 1] or uint8")
    if x.ndim != 3 or x.shape[-2:] not in ((IMAGE_SIZE, IMAGE_SIZE), (8, 8)):
        raise ValueError(f"digit images of shape {tuple(x.shape)}; expected [N, 16, 16] or [N, 8, 8] "
                         f"(or [N, 1, H, W] float / [N, H, W, C] uint8)")
    if x.shape[-1] == 8:
        x = F.interpolate(x[:, None], size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)[:, 0]
    return x


def _prompt_class_probability(probabilities, images: Any, prompts: Sequence[str]) -> np.ndarray:
    """probabilities(images)[i, digit named by prompts[i]]; prompts are parsed first so a bad one fails fast."""
    digits = np.asarray([prompt_digit(p) for p in prompts], dtype=np.int64)
    return probabilities(images)[np.arange(len(digits)), digits].astype(np.float64)


@register_reward("digit_classifier")
class DigitClassifierReward:
    """P_cnn(prompt's digit | image).  ``cache_dir``: where the trained CNN is kept (default
    ~/.cache/megatron_omni/rewards/digits); ``device``: where it runs (images are moved there)."""

    def __init__(self, cache_dir: str | None = None, device: str | torch.device = "cpu"):
        trained = load_or_train_cnn(cache_dir)
        self.test_accuracy, self.train_seconds = trained.test_accuracy, trained.train_seconds
        self.device = torch.device(device)
        self.model = trained.model.to(self.device).requires_grad_(False)  # scored, never trained here

    def probabilities(self, images: Any) -> np.ndarray:
        """Class probabilities [N, 10]."""
        with torch.no_grad():
            return self.model(to_digit_images(images).to(self.device)).softmax(-1).cpu().numpy()

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> np.ndarray:
        return _prompt_class_probability(self.probabilities, images, prompts)

    def differentiable_scores(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """The reward as a torch tensor [N] with gradients in ``images`` (float [N, H, W] in [0, 1]), on their
        device; the CNN's own weights stay frozen (the reward registry's differentiable scorer interface)."""
        digits = torch.tensor([prompt_digit(p) for p in prompts], dtype=torch.long, device=self.device)
        probs = self.model(to_digit_images(images).to(self.device)).softmax(-1)
        return probs.gather(1, digits[:, None])[:, 0].to(images.device)


@register_reward("digit_judge")
class DigitJudgeReward:
    """P_svc(prompt's digit | image pooled to 8×8): the held-out judge; not for training."""

    def __init__(self, cache_dir: str | None = None):
        trained = load_or_train_judge(cache_dir)
        self.test_accuracy, self.train_seconds = trained.test_accuracy, trained.train_seconds
        self.model = trained.model
        if list(self.model.classes_) != list(range(10)):
            raise ValueError(f"digit judge at {trained.path} knows classes {list(self.model.classes_)}; "
                             f"expected 0..9 — delete the file to retrain")

    def probabilities(self, images: Any) -> np.ndarray:
        return self.model.predict_proba(pool_to_8x8(to_digit_images(images)))

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> np.ndarray:
        return _prompt_class_probability(self.probabilities, images, prompts)
