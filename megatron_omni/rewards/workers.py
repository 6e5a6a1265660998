"""Reward workers that score a batch in background threads while the next rollout batch is sampled.

Protocol: ``future = pool.submit(images, prompts, metadata, latents=...)`` returns at once → the caller keeps
sampling → ``future.result()`` gives ``{reward name: float64 [N]}`` or raises the first
:class:`RewardError` (a reward that raised, or returned NaN/inf or the wrong length; the message names
the reward and the sample — a failed reward is never scored 0).

Threads, not processes: the expensive parts release the GIL (tesseract inside tesserocr, torch
kernels, JPEG encoding in PIL), and threads share the loaded models and the images without copies.
``chunk_size`` splits each batch so a per-image reward such as OCR runs on several workers at once.
Each reward gets what it reads (registry.reads_of: the decoded images, or the clean latents); ``reads(kind)`` tells
the caller which of the two it must produce, so a run of latent rewards only never decodes.
The pool keeps references to the submitted images: do not modify them in place before ``result()``.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before Python 3.11
from typing import Mapping, Sequence

import numpy as np

from megatron_omni.rewards.registry import Images, RewardFn, check_batch, num_samples, reads_of, score_batch


class RewardFuture:
    """The scores of one submitted batch, computed in the background."""

    def __init__(self, parts: dict[str, list[Future]]):
        self._parts = parts  # reward name -> futures of its chunks, in sample order

    def done(self) -> bool:
        return all(f.done() for futures in self._parts.values() for f in futures)

    def result(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Block until every reward is scored (at most ``timeout`` seconds in all); ``{name: float64 [N]}``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        scores = {}
        for name, futures in self._parts.items():
            chunks = []
            for future in futures:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    chunks.append(future.result(remaining))  # re-raises the worker's RewardError
                except FutureTimeout as err:
                    pending = sorted(n for n, fs in self._parts.items() if not all(f.done() for f in fs))
                    raise TimeoutError(f"rewards {pending} not done after {timeout} s; expected them within "
                                       f"the timeout (raise it, or add workers)") from err
            scores[name] = np.concatenate(chunks) if chunks else np.zeros(0)
        return scores


class AsyncRewardPool:
    """Score batches with several rewards in ``num_workers`` background threads.

    ``reward_fns``: ``{name: reward}`` (e.g. ``{"ocr": build_reward("ocr")}``); ``chunk_size``: samples per
    task (None: one task per reward and batch).  Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, reward_fns: Mapping[str, RewardFn], num_workers: int = 4, chunk_size: int | None = None):
        if not reward_fns:
            raise ValueError("AsyncRewardPool got no rewards; expected {name: reward callable}")
        not_callable = [name for name, fn in reward_fns.items() if not callable(fn)]
        if not_callable:
            raise TypeError(f"rewards {not_callable} are not callable; expected reward(images, prompts, metadata)")
        if num_workers < 1 or (chunk_size is not None and chunk_size < 1):
            raise ValueError(f"num_workers={num_workers}, chunk_size={chunk_size}; expected integers >= 1")
        self.reward_fns = dict(reward_fns)
        self.inputs = {name: reads_of(fn) for name, fn in self.reward_fns.items()}  # "images" or "latents"
        self.chunk_size = chunk_size
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(num_workers, thread_name_prefix="reward")

    def reads(self, kind: str) -> bool:
        """Whether any reward scores ``kind`` ("images" or "latents"): the caller produces only what is read."""
        return kind in self.inputs.values()

    def submit(self, images: Images | None, prompts: Sequence[str], metadata: Sequence[dict] | None = None,
               latents=None) -> RewardFuture:
        """Queue the batch for every reward and return at once; each reward gets the ``images`` or the ``latents``
        (float [N, Z, H, W]) it reads, and either may be None when no reward reads it.  Batch sizes are checked
        here, so a mismatch fails in the caller's thread."""
        if self._executor is None:
            raise RuntimeError("AsyncRewardPool.submit after close(); expected an open pool")
        given = {"images": images, "latents": latents}
        missing = {name: kind for name, kind in self.inputs.items() if given[kind] is None}
        if missing:
            raise ValueError(f"rewards {missing} read inputs that were not given; expected submit() to pass "
                             f"{sorted(set(missing.values()))}")
        n = None
        for kind, batch in given.items():
            if batch is not None:
                metadata = check_batch(batch, prompts, metadata)
                n = num_samples(batch)
        if n is None:
            raise ValueError("submit() got neither images nor latents; expected the batch to score")
        step = self.chunk_size or max(n, 1)
        parts = {
            name: [self._executor.submit(score_batch, name, fn, given[self.inputs[name]][s:s + step],
                                         list(prompts[s:s + step]), metadata[s:s + step], s)
                   for s in range(0, n, step)]
            for name, fn in self.reward_fns.items()}
        return RewardFuture(parts)

    def close(self, wait: bool = True) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=not wait)
            self._executor = None

    def __enter__(self) -> "AsyncRewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
