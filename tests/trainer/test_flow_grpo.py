"""The FlowGRPO loop end to end on a tiny digits run: a killed run resumed from its checkpoint continues
exactly as an uninterrupted one; rollout and trainer log-probs agree; the run folder has its outputs."""
import json

import pytest

from megatron_omni.config import load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.trainer.flow_grpo import train

TIMING = ("rollout_seconds", "reward_seconds", "train_seconds", "sync_seconds", "step_seconds", "images_per_second",
          "tflops_per_second", "mfu")
TINY = ["train.steps=4", "train.save_every=2", "train.micro_batch_size=8", "train.global_batch_size=8",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled", "model.arch.num_layers=2"]


@pytest.fixture(scope="module")
def task():
    return build_task("digits")


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_killed_run_resumes_exactly(tmp_path, single_rank, task):
    cfg = load_config("digits_flow_grpo", None, TINY)
    train(cfg, single_rank, task, tmp_path / "whole")
    # the same run killed after step 2 (checkpoint after step 1), then resumed from that checkpoint
    train(cfg, single_rank, task, tmp_path / "killed", stop_after=3)
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "1"
    assert len(_metrics(tmp_path / "killed")) == 3
    train(cfg, single_rank, task, tmp_path / "killed", resume=True)

    whole, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "killed")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    assert resumed == whole  # rewards, losses, ratios, grad norms: bit for bit
    assert len({m["reward_mean"] for m in whole}) > 1 and whole[-1]["grad_norm"] > 0


def test_run_folder_and_logprob_consistency(tmp_path, single_rank, task):
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=2"])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    for m in done:  # rollout batches of >= 4 rows: the trainer re-scores the rollout bit for bit
        assert m["logprob_abs_diff"] < 1e-5 and m["logprob_pearson"] > 0.9999
        for key in ("reward_mean", "judge_mean", "zero_std_ratio", "clipfrac_above", "approx_kl", "grad_norm"):
            assert key in m
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"metrics.jsonl", "reward_curve.png", "samples_step00000.png", "checkpoints"} <= names


def test_lora_run_trains_adapters_only_with_kl_to_the_base(tmp_path, single_rank, task):
    cfg = load_config("digits_flow_grpo", None, TINY + ["train.steps=1", "lora.rank=4", "algorithm.kl_beta=0.01"])
    run, done = train(cfg, single_rank, task, tmp_path / "lora")
    trainable = [n for n, p in run.policy.module.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert done[0]["grad_norm"] > 0 and done[0]["kl"] >= 0
    # the engine received merged weights: W + (alpha/r) B A, not the bare base
    assert any(m.delta_weight().abs().max() > 0 for m in __import__("model_specs.common.lora", fromlist=["x"])
               .lora_modules(run.policy.module).values())
