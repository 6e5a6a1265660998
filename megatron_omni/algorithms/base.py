"""``Algorithm``: everything the RL loop may ask an RL algorithm, and ``RecordSpec``, what it asks the rollout to
keep.  One folder per algorithm under ``megatron_omni/algorithms/<name>/`` holding its subclass as ``ALGORITHM``,
registered by one line in ``megatron_omni.algorithms.registry.ALGORITHMS``.

The loop's verbs, in order (megatron_omni.trainer.loop):
    requests(run, step)            what to sample: prompts, groups, seeds, sampler, windows
    generate                       the engine samples and keeps what ``record_spec`` asks
    check(run, trajs, text)        rollout <-> trainer consistency (metrics), before any update
    advantages(run, trajs, rewards)   per-sample credit (or pairs)
    train(run, trajs, adv, text)   micro-batches -> optimizer steps inside megatron's forward_backward_func
    flops(run, trajs, text)        the step's DiT work, for MFU
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordSpec:
    """What the rollout keeps of each trajectory.  Every recorded step carries the sampler kind and log-prob form
    that drew it (``Trajectory.request.sampler`` / ``.log_prob_form``), so a trainer scores it with that formula."""

    step_latents: bool = True  # x_t of every step (x_t' of a trained step is the next one)
    log_probs: bool = True  # log π_old of the trained steps
    uncond_outputs: bool = False  # true CFG: the uncond velocity at trained steps (reused by the first update)


class Algorithm:
    """Base class; a subclass answers each verb.  ``reference`` is the policy the loss compares against:
    "none", "initial" (the frozen start: LoRA adapters off, else a copy) or "previous" (the last update's)."""

    name: str = ""
    reference: str = "none"

    def check_config(self, cfg) -> None:
        """ValueError naming a setting of ``cfg.algorithm`` that cannot work (the run config validates with it)."""

    def record_spec(self, cfg) -> RecordSpec:
        return RecordSpec()

    def needs_reference(self, cfg) -> bool:
        return self.reference != "none"

    def build_state(self, cfg, policy):
        """The algorithm's own state between RL steps (``Run.algorithm_state``, e.g. an EMA of the policy), built
        before a checkpoint is loaded; checkpointed with the weights through ``sharded_state_dict(model_sd)`` and
        ``load(loaded)`` (megatron_omni.algorithms.ema_policy).  None: the algorithm keeps none."""
        return None

    def forward_step(self, cfg, reference):
        """megatron-core ``forward_step_func`` whose ``loss_func`` is this algorithm's loss."""
        raise NotImplementedError

    def requests(self, run, step: int) -> list:
        raise NotImplementedError

    def check(self, run, trajs: list, text) -> dict[str, float]:
        return {}

    def advantages(self, run, trajs: list, rewards) -> Any:
        raise NotImplementedError

    def train(self, run, trajs: list, advantages, text) -> dict[str, float]:
        raise NotImplementedError

    def flops(self, run, trajs: list, text) -> float:
        raise NotImplementedError
