"""Rewards: a registry of reward callables and background workers that score rollouts.

``build_reward(name, **options)`` makes a reward ``(images, prompts, metadata) -> float [N]``
(the contract is in :mod:`.registry`); ``AsyncRewardPool`` scores batches in threads while the next
batch is sampled.  Registered rewards:

- ``jpeg_compressibility`` / ``jpeg_incompressibility`` (:mod:`.rule`): ∓ JPEG size in kB at quality 95;
- ``ocr`` (:mod:`.ocr`): tesseract reads the image, scored against the prompt's quoted text;
- ``digit_classifier`` / ``digit_judge`` (:mod:`.digits`): a CNN reward and an independent SVC judge
  for the handwritten-digit demo;
- ``latent_scorer`` / ``latent_http`` (:mod:`.latent`): scorers of the clean latents (``reads = "latents"``), in
  this process or on a server; a run whose rewards all read latents decodes nothing.

Importing this package is cheap: tesserocr, rapidfuzz and scikit-learn load when a reward is built.
"""
from megatron_omni.rewards import digits, latent, ocr, rule  # noqa: F401  (import registers the rewards)
from megatron_omni.rewards.registry import (RewardError, RewardFn, build_reward, check_options, check_rewards,
                                            compute_rewards, list_rewards, reads_of, register_reward)
from megatron_omni.rewards.workers import AsyncRewardPool, RewardFuture

__all__ = ["AsyncRewardPool", "RewardError", "RewardFn", "RewardFuture", "build_reward", "check_options",
           "check_rewards", "compute_rewards", "list_rewards", "reads_of", "register_reward"]
