"""Every registered algorithm at PP=2 on 2 gloo ranks: ``megatron-omni train --recipe digits_flow_grpo
algorithm.name=<name> train.steps=2 parallel.pp=2`` (in process on each rank, the shrunk digits run of
test_algorithm_runs: 2 layers, one per stage), both ranks reporting the last stage's metrics alike.  One launch
runs them all (one text encoder load per rank): the cheapest form of the check."""
from __future__ import annotations

import math

import pytest

from megatron_omni.algorithms import algorithm_names
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.loop import TIMING_METRICS as TIMING

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # slow: not rerun under avx2 (make test)

TINY = ["train.steps=2", "train.save_every=0", "train.micro_batch_size=8", "train.global_batch_size=16",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "rollout.window_range=[0,1]", "algorithm.logprob_check_samples=8", "logging.wandb_mode=disabled",
        "model.arch.num_layers=2", "reward.workers=1", "parallel.pp=2"]
# 16 rows: one optimizer step; DiffusionNFT's EMA previous policy and Diffusion-DPO's initial-weights reference, both
# swapped in for a forward-only pass of the schedule (the full fine-tune's; LoRA's adapters-off in test_lora / runs)
OWN = {"diffusion_nft": ["algorithm.diffusion_nft.timesteps_per_sample=2", "algorithm.diffusion_nft.old_policy=ema",
                         "algorithm.diffusion_nft.ema_decay=0.5"]}


def _every_algorithm(state, names, root):
    import torch

    from megatron_omni.config import load_config
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    torch.set_num_threads(1)
    task, out = build_task("digits"), {}
    for name in names:
        cfg = load_config("digits_flow_grpo", None, [f"algorithm.name={name}", *TINY, *OWN.get(name, [])])
        _, done = train(cfg, state, task, root / name)
        out[name] = [{k: v for k, v in m.items() if k not in TIMING} for m in done]
    return out


def test_every_algorithm_runs_at_pp2(tmp_path):
    names = algorithm_names()
    ranks = run_distributed(_every_algorithm, world_size=2, parallel={"pp": 2}, args=(names, tmp_path),
                            timeout_s=1200)
    assert ranks[0] == ranks[1]  # the last stage's metrics on both ranks
    for name in names:
        done = ranks[0][name]
        assert [m["step"] for m in done] == [0, 1], name
        for m in done:
            assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["optimizer_steps"] >= 1, (name, m)

