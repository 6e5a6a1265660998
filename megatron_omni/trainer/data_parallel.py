"""The RL step over data-parallel replicas: each replica samples, scores and trains on its own share of the step's
prompt groups; the step's statistics are those of all of them.

* ``shard_requests``: a step's requests (whole groups, by ``prompt_id``) split into contiguous blocks, one per
  data-parallel rank, so no prompt group is sampled twice and group advantages stay local to a replica.  The
  requests are the algorithm's for the whole step (seeds are functions of (seed, step, global index)), so a run
  at DP = 2 samples exactly the trajectories of the run at DP = 1, half on each replica.
* ``gather_scores``: every replica's reward scores in replica order, i.e. request order (reward means and stds
  over the step, and ``step_advantages``: the step-wide std normalisation over every replica's samples).
* ``mean_over_dp``: a replica's scalar metrics averaged over the replicas (losses, ratios, clip fractions, the
  log-prob check; the gradient norm is already the same on every replica after DDP's all-reduce).
With one replica each is the identity and runs no collective.  Context-parallel ranks of a replica share its
requests (``ParallelState.dp`` excludes CP), as tensor- and pipeline-parallel ranks do.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist


def shard_bounds(requests: list, dp: int, dp_rank: int, even: bool = True) -> tuple[int, int]:
    """[lo, hi) of this data-parallel rank's requests: whole prompt groups (consecutive equal ``prompt_id``s),
    the ``dp_rank``-th of ``dp`` contiguous blocks.  ``even``: the groups must divide evenly (training: every
    replica runs the same number of micro-batches, which DDP's gradient all-reduce needs); else the first blocks
    take one group more (evaluation)."""
    if dp == 1:
        return 0, len(requests)
    starts = [i for i, r in enumerate(requests) if i == 0 or r.prompt_id != requests[i - 1].prompt_id]
    if even and len(starts) % dp:
        raise ValueError(f"{len(starts)} prompt groups in an RL step for {dp} data-parallel replicas; expected "
                         f"rollout.prompts_per_step to be a multiple of the data-parallel size {dp}")
    base, extra = divmod(len(starts), dp)
    first = dp_rank * base + min(dp_rank, extra)
    last = first + base + (dp_rank < extra)
    bounds = starts + [len(requests)]
    return bounds[first], bounds[last]


def shard_requests(requests: list, dp: int, dp_rank: int, even: bool = True) -> list:
    """This data-parallel rank's requests (``shard_bounds``)."""
    lo, hi = shard_bounds(requests, dp, dp_rank, even)
    return requests[lo:hi]


class _Sample:
    """A trajectory as the advantage verb reads another replica's: its request (prompt id) only."""

    def __init__(self, request):
        self.request = request


def step_advantages(algorithm, run, requests: list, bounds: tuple[int, int], rewards) -> object:
    """This replica's advantages from the whole step's rewards (``rewards``: every replica's, in request order):
    group means are a group's own, but a step-wide normalisation (``algorithm.adv_std="global"``) is over every
    replica's samples, as at DP = 1."""
    from megatron_omni.algorithms.advantages import GroupAdvantages

    lo, hi = bounds
    whole = algorithm.advantages(run, [_Sample(q) for q in requests], rewards)
    if not isinstance(whole, GroupAdvantages):
        raise ValueError(f"algorithm {algorithm.name!r}: its advantages ({type(whole).__name__}) cannot be split over "
                         f"data-parallel replicas yet; expected GroupAdvantages, or a data-parallel size of 1")
    return replace(whole, advantages=whole.advantages[lo:hi], keep=whole.keep[lo:hi])


def gather_scores(scores: dict[str, np.ndarray], state) -> dict[str, np.ndarray]:
    """Each reward's scores of every data-parallel replica, concatenated in replica order."""
    if state.dp == 1:
        return scores
    parts: list = [None] * state.dp
    dist.all_gather_object(parts, {k: np.asarray(v) for k, v in scores.items()}, group=state.dp_group)
    keys = list(dict.fromkeys(k for p in parts for k in p))  # (a replica with no share of an eval has none)
    return {k: np.concatenate([p[k] for p in parts if k in p]) for k in keys}


def mean_over_dp(metrics: dict[str, float], state) -> dict[str, float]:
    """The numeric metrics averaged over the data-parallel replicas (float64 sums; every replica the same keys)."""
    if state.dp == 1:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=state.torch_device)
    dist.all_reduce(values, group=state.dp_group)
    return {**metrics, **{k: v.item() for k, v in zip(keys, (values / state.dp).cpu())}}
