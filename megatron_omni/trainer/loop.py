"""The RL loop: generate → score → train → update weights → log and save.  Every verb belongs to an object of the
run (megatron_omni.trainer.build): the algorithm (megatron_omni.algorithms), the engine, the reward pool, the
weight updater, the logger and the checkpointer.

Every random draw is a function of (seed, step, index), so a run resumed from a checkpoint continues exactly as
an uninterrupted one.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_omni.config.schema import RunConfig
from megatron_omni.data.tasks import Task
from megatron_omni.parallel.state import ParallelState
from megatron_omni.trainer.build import Run, build_run, scores_of
from megatron_omni.trainer.data_parallel import gather_scores, mean_over_dp, shard_bounds, step_advantages
from megatron_omni.trainer.evaluate import evaluate
from megatron_omni.trainer.mfu import replica_peak_flops, utilisation as mfu_utilisation
from megatron_omni.trainer.preemption import Preempted, StopSignals


# the metrics of a step that measure its time, not its numbers (left out wherever two runs' metrics are compared)
TIMING_METRICS = frozenset({"rollout_seconds", "rollout_sampling_seconds", "rollout_scoring_seconds",
                            "reward_seconds", "train_seconds", "sync_seconds", "step_seconds", "images_per_second",
                            "tflops_per_second", "mfu"})


class StepClock:
    """Seconds per phase of one RL step, as ``<phase>_seconds`` metrics (a phase timed twice: the sum)."""

    def __init__(self):
        self.start, self.seconds = time.perf_counter(), {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        key = f"{phase}_seconds"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self.start


def rl_step(run: Run, step: int) -> dict[str, Any]:
    """One RL step; under data parallelism on this replica's share of the step's prompt groups
    (megatron_omni.trainer.data_parallel), its metrics those of the whole step (the same on every replica)."""
    algo, clock, state = run.algorithm, StepClock(), run.policy.state
    requests = algo.requests(run, step)
    bounds = shard_bounds(requests, state.dp, state.dp_rank)
    with clock("rollout"):
        trajs, images, pending = run.rollout(requests[bounds[0]:bounds[1]],
                                             clock=lambda part: clock(f"rollout_{part}"))
    with clock("reward"):
        text = run.text_for(trajs)
        check = algo.check(run, trajs, text)  # while the reward threads score the second half
        scores = scores_of(pending)
        step_scores = gather_scores(scores, state)  # every replica's, in request order
    if state.dp == 1:
        advantages = algo.advantages(run, trajs, scores["reward"])
    else:
        advantages = step_advantages(algo, run, requests, bounds, step_scores["reward"])
    with clock("train"):
        run.task.park()  # its text encoder and VAE to host memory until the next rollout (data.offload_encoders)
        run.engine.park()  # the merged adapters' weight copies, rebuilt from the next sync's (rollout.lora_weights)
        trained = algo.train(run, trajs, advantages, text)  # (reports the check when its forward was the check's)
    trained, check = mean_over_dp(trained, state), mean_over_dp(check, state)
    warn_on_logprob_gap(run.cfg, step, {**check, **trained})
    with clock("sync"):
        run.updater.push()
    seconds = clock.total()
    metrics = {f"{k}_mean": float(v.mean()) for k, v in step_scores.items()}
    metrics.update({f"{k}_std": float(v.std()) for k, v in step_scores.items()})
    metrics.update(utilisation(run, algo.flops(run, trajs, text), seconds))  # a replica's rate, MFU per device
    metrics.update(lr=run.cfg.train.lr, **trained, **check, **clock.seconds, step_seconds=seconds,
                   images_per_second=len(trajs) * state.dp / seconds, sync_restarts=run.updater.restarts)
    labels = [f"{t.request.prompt}\nreward {float(r):.2f}" for t, r in zip(trajs, scores["reward"])]
    return {"metrics": metrics, "images": images, "labels": labels}


def train(cfg: RunConfig, state: ParallelState, task: Task, run_dir: str | Path, resume: bool = False,
          stop_after: int | None = None) -> tuple[Run, list[dict]]:
    """Run (or resume) the loop; returns the run (its policy is the trained one) and the metrics of the steps run
    here.  The last step is always checkpointed.  ``stop_after`` ends this call after that many steps without a
    final checkpoint, as a killed process would (used to test resume).  SIGUSR1 / SIGTERM end it after the step in
    flight, checkpointed, with ``Preempted`` (megatron_omni.trainer.preemption)."""
    run, start = build_run(cfg, state, task, Path(run_dir), resume)
    done, last, signals = [], cfg.train.steps - 1, StopSignals(state.torch_device)
    try:
        for step in range(start, cfg.train.steps):
            result = rl_step(run, step)
            if cfg.train.eval_every and ((step + 1) % cfg.train.eval_every == 0 or step == last):
                result["metrics"].update(evaluate(run, step))
            run.logger.log_step(step, result["metrics"])
            done.append({"step": step, **result["metrics"]})
            if result["images"] is not None and (step % max(1, cfg.train.steps // 4) == 0 or step == last):
                run.logger.log_images(step, run.preview(result["images"][:64]), labels=result["labels"][:64])
            if stop_after is not None and len(done) >= stop_after:
                break
            stop = signals.requested() and step != last
            if stop or step == last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                run.checkpointer.save(step, run.policy.models, run.policy.optimizer, {}, run.algorithm_state)
            if stop:
                raise Preempted(step, signals.signame)
    finally:
        signals.close()
        run.close()
    return run, done


def warn_on_logprob_gap(cfg: RunConfig, step: int, check: dict[str, float]) -> None:
    gap = check.get("logprob_abs_diff")
    if gap is not None and gap > cfg.algorithm.logprob_warn_abs:
        print(f"warning: step {step}: rollout and trainer log-probs differ by {gap:.3g} on average (threshold "
              f"{cfg.algorithm.logprob_warn_abs}); Pearson r {check['logprob_pearson']:.4f}")


def utilisation(run: Run, flops: float, seconds: float) -> dict[str, float]:
    """Achieved TFLOP/s of the step's DiT work (``flops``: one data-parallel replica's, which its tp x cp x pp
    devices share), and MFU per device where the device's peak is known: the replica's rate over its devices'
    summed peak."""
    return mfu_utilisation(flops, seconds, replica_peak_flops(run.cfg.model.torch_dtype, run.policy.state))
