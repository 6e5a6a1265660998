"""Evaluation on the task's held-out prompts: deterministic (ODE) samples at fixed seeds, the same at every
evaluation, scored by the run's rewards and logged as ``eval_<reward>_mean`` plus a grid labelled with each tile's
prompt and reward (``eval_stepNNNNN.png``; none when every reward reads latents, so nothing is decoded)."""
from __future__ import annotations

from megatron_omni.data.prompts import request_seed
from megatron_omni.rollout.engine import Request
from megatron_omni.trainer.data_parallel import gather_scores, shard_requests

EVAL_SEED = 7_777  # the eval samples' seeds: request_seed(EVAL_SEED, 0, i), whatever the run's seed and step


def eval_requests(run) -> list[Request]:
    """One ODE request per held-out record (with its negative prompt, and an edit's source image)."""
    r, task = run.cfg.rollout, run.task
    records = task.dataset(held_out=True)
    if records is None:
        return []
    schedule = None if task.sigmas is None else tuple(task.sigmas(r.num_steps).tolist())
    cfg = r.guidance_scale > 1
    return [Request(prompt=p.prompt, prompt_id=i, seed=request_seed(EVAL_SEED, 0, i), img_fhw=task.img_fhw,
                    negative_prompt=p.negative_prompt or "", num_steps=r.num_steps, shift=r.shift, sigmas=schedule,
                    sampler="ode", guidance_scale=r.guidance_scale, cfg_rescale=run.family.guidance_rescale,
                    **task.inputs_for(p, p.negative_prompt or "", cfg))
            for i, p in enumerate(records)]


def evaluate(run, step: int) -> dict[str, float]:
    """The held-out metrics of the policy the engine holds now (after this step's weight update); under data
    parallelism each replica samples its share of the prompts, the means are over all of them and the grid
    shows the first replica's."""
    state = run.policy.state
    requests = shard_requests(eval_requests(run), state.dp, state.dp_rank, even=False)
    scores = {}
    if requests:
        images, future = run.score(run.engine.generate(requests))
        scores = future.result()
        labels = [q.prompt + "".join(f"\n{name} {float(values[i]):.2f}" for name, values in scores.items())
                  for i, q in enumerate(requests)]
        if images is not None:  # None: the rewards read latents only, and nothing was decoded
            run.logger.log_images(step, run.preview(images), name="eval", labels=labels)
    scores = gather_scores(scores, state) if state.dp > 1 else scores
    return {f"eval_{name}_mean": float(values.mean()) for name, values in scores.items() if len(values)}
