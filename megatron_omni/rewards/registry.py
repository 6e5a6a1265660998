"""Reward registry, the reward call contract, and the checks every reward result goes through.

A *reward* is a callable ``reward(images, prompts, metadata) -> float array [N]``:

- ``images``: a list of N ``PIL.Image`` or a uint8 tensor / array ``[N, H, W, C]`` (C = 1, 3 or 4);
  single rewards may accept more (the digit rewards also read float grayscale in [0, 1]);
- ``prompts``: N strings; ``metadata``: N dicts (``None`` means N empty dicts);
- the result: one finite score per sample, higher is better (numpy or torch, any float dtype).

A reward that scores clean latents instead of pixels (DiNa-LRM-style: :mod:`.latent`) says so with the class
attribute ``reads = "latents"``; it is then called as ``reward(latents_NZHW, prompts, metadata)`` with the
denoiser's final latents as float32 ``[N, Z, H, W]`` (the task's ``latents``: the flow's space, before the VAE's
de-normalisation).  ``reads`` defaults to ``"images"``.  A run whose rewards all read latents decodes nothing.

Rewards are registered by name with :func:`register_reward` on a *factory* (a class or function that
takes the reward's options as keywords) so a config can say ``name + kwargs`` and
:func:`build_reward` makes the callable.  :func:`check_rewards` is the one place a result is
validated: a NaN, an inf or a wrong length is an error naming the reward and the sample, never a
silent 0 that would be normalised into an advantage.

A reward whose score has gradients (SRPO back-propagates it: megatron_omni.algorithms.srpo) also offers
``reward.differentiable_scores(images, prompts) -> torch.Tensor [N]``: ``images`` a float tensor as its decode gives
them (the digit rewards: [N, H, W] in [0, 1]), the result differentiable in them; :func:`has_gradient` asks a
registered factory without building it.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol, Sequence

import numpy as np

Images = Any  # a list of N PIL.Image, or a uint8 [N, H, W, C] torch tensor / numpy array
READS = ("images", "latents")  # what a reward scores: decoded images, or the denoiser's clean latents


class RewardError(RuntimeError):
    """A reward failed or returned an unusable score; the message names the reward and the sample."""


class RewardFn(Protocol):
    def __call__(self, images: Images, prompts: Sequence[str],
                 metadata: Sequence[dict] | None) -> Any: ...


_FACTORIES: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Class/function decorator: ``build_reward(name, **kw)`` will call ``factory(**kw)``."""
    def decorate(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"reward name {name!r} is already registered to {_FACTORIES[name]!r}; "
                             f"expected a new name for {factory!r}")
        _FACTORIES[name] = factory
        return factory
    return decorate


def list_rewards() -> list[str]:
    return sorted(_FACTORIES)


def build_reward(name: str, **kwargs: Any) -> RewardFn:
    """The reward registered as ``name``, built with ``kwargs`` (its options)."""
    if name not in _FACTORIES:
        raise KeyError(f"unknown reward {name!r}; expected one of {list_rewards()}")
    return _FACTORIES[name](**kwargs)


def reads_of(fn: RewardFn) -> str:
    """What ``fn`` scores: its ``reads`` attribute ("images" when it has none)."""
    reads = getattr(fn, "reads", "images")
    if reads not in READS:
        raise ValueError(f"reward {fn!r} declares reads={reads!r}; expected one of {READS}")
    return reads


def check_options(name: str, options: dict[str, Any]) -> None:
    """ValueError unless ``build_reward(name, **options)`` would accept the options (checked against the factory's
    signature, without building: a config is validated before any model or server is touched)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown reward {name!r}; expected one of {list_rewards()}")
    signature = inspect.signature(_FACTORIES[name])
    try:
        signature.bind(**options)
    except TypeError as err:
        known = [p for p in signature.parameters if p != "self"]
        raise ValueError(f"options {sorted(options)} do not fit reward {name!r} ({err}); expected keys among "
                         f"{known}") from None


def num_samples(images: Images) -> int:
    """N of a batch of images in any accepted format (list, array or tensor with batch first)."""
    if hasattr(images, "shape"):
        return int(images.shape[0])
    return len(images)


def check_batch(images: Images, prompts: Sequence[str], metadata: Sequence[dict] | None) -> list[dict]:
    """Same N for images, prompts and metadata; returns the metadata list (N empty dicts for None)."""
    n = num_samples(images)
    if isinstance(prompts, str) or len(prompts) != n:
        raise ValueError(f"got {n} images but prompts={prompts!r:.80}; expected a list of {n} strings")
    if metadata is None:
        return [{} for _ in range(n)]
    if len(metadata) != n:
        raise ValueError(f"got {n} images but {len(metadata)} metadata entries; expected {n} dicts")
    return list(metadata)


def check_rewards(name: str, values: Any, prompts: Sequence[str], offset: int = 0) -> np.ndarray:
    """``values`` as a float64 numpy array [N], or a :class:`RewardError` naming reward and sample.

    ``offset`` is the index of ``prompts[0]`` in the whole batch (the pool scores batches in chunks),
    so the error names the sample as the caller numbered it.
    """
    if hasattr(values, "detach"):  # a torch tensor, possibly on an accelerator or requiring grad
        values = values.detach().double().cpu().numpy()
    try:
        scores = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise RewardError(f"reward {name!r} returned {type(values).__name__} {values!r:.80}; "
                          f"expected {len(prompts)} floats") from err
    if scores.shape != (len(prompts),):
        raise RewardError(f"reward {name!r} returned shape {tuple(scores.shape)} for {len(prompts)} samples "
                          f"(indices {offset}..{offset + len(prompts) - 1}); expected ({len(prompts)},)")
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        i = int(bad[0])
        raise RewardError(f"reward {name!r} returned {scores[i]} for sample {offset + i} "
                          f"(prompt {prompts[i]!r}); expected a finite float "
                          f"({bad.size} non-finite of {len(prompts)})")
    return scores


def score_batch(name: str, fn: RewardFn, images: Images, prompts: Sequence[str],
                metadata: Sequence[dict] | None, offset: int = 0) -> np.ndarray:
    """Run one reward on one batch and validate the result; an exception inside the reward is re-raised
    as a :class:`RewardError` naming the reward and the sample range (the cause stays chained)."""
    metadata = check_batch(images, prompts, metadata)
    try:
        values = fn(images, prompts, metadata)
    except Exception as err:
        last = offset + len(prompts) - 1
        raise RewardError(f"reward {name!r} raised {type(err).__name__} on samples {offset}..{last} "
                          f"(first prompt {prompts[0] if prompts else None!r}): {err}") from err
    return check_rewards(name, values, prompts, offset)


def compute_rewards(reward_fns: dict[str, RewardFn], images: Images, prompts: Sequence[str],
                    metadata: Sequence[dict] | None = None) -> dict[str, np.ndarray]:
    """Every reward on the batch, in the calling thread: ``{name: float64 [N]}``."""
    return {name: score_batch(name, fn, images, prompts, metadata) for name, fn in reward_fns.items()}


def has_gradient(name: str) -> bool:
    """Whether the reward registered as ``name`` offers ``differentiable_scores`` (scores with gradients)."""
    return callable(getattr(_FACTORIES.get(name), "differentiable_scores", None))


def differentiable_rewards() -> list[str]:
    return [name for name in list_rewards() if has_gradient(name)]
