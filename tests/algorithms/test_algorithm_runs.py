"""``megatron-omni train --recipe digits_flow_grpo algorithm.name=<name> train.steps=2`` for every algorithm of
issue 23, in process on a shrunk digits run (2 prompts x 4 samples, a 2-step window, 2 layers), and an unknown name
refused with the known ones listed."""
import json
import math

import pytest

from megatron_omni.algorithms import algorithm_names
from megatron_omni.config import ConfigError, load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.trainer.loop import train

# 2 prompts x 4 samples x a 2-step window = 16 pairs = one optimizer step per RL step (its weights the rollout's)
TINY = ["train.steps=2", "train.save_every=0", "train.micro_batch_size=8", "train.global_batch_size=16",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "rollout.window_range=[0,1]", "algorithm.logprob_check_samples=8", "logging.wandb_mode=disabled",
        "model.arch.num_layers=2"]


@pytest.fixture(scope="module")
def task():
    return build_task("digits")


def _train(tmp_path, single_rank, task, name, *overrides):
    cfg = load_config("digits_flow_grpo", None, [f"algorithm.name={name}", *TINY, *overrides])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    assert len(done) == 2
    for m in done:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
        assert m["logprob_abs_diff"] <= 1e-6  # the rollout's steps re-scored by the trainer to rounding
    return done


@pytest.mark.numerics
def test_mix_grpo_progressive_window(tmp_path, single_rank, task):
    done = _train(tmp_path, single_rank, task, "mix_grpo")
    assert [m["window_start"] for m in done] == [0.0, 1.0]  # every sample's window, moved by one per step
    assert all(m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) for m in done)


@pytest.mark.numerics
@pytest.mark.parametrize("name,key", [("grpo_guard", "mean_bias"), ("flow_dppo", "old_kl")])
def test_old_means_are_the_rollout_weights(tmp_path, single_rank, task, name, key):
    """One optimizer step per RL step: μ_old comes from the weights the loss runs at, so the mean shift is 0."""
    done = _train(tmp_path, single_rank, task, name)
    for m in done:
        assert m[key] == 0.0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        if name == "flow_dppo":
            assert m["masked_frac"] == 0.0


@pytest.mark.numerics
def test_old_means_stay_the_rollouts_after_an_update(tmp_path, single_rank, task):
    """Two optimizer steps per RL step: the second runs at updated weights against the first's μ_old."""
    done = _train(tmp_path, single_rank, task, "grpo_guard", "train.global_batch_size=8")
    assert all(m["optimizer_steps"] == 2 and m["mean_bias"] > 0 for m in done)


@pytest.mark.numerics
@pytest.mark.parametrize("overrides,steps", [([], 1.0), (["rollout.sampler=dance", "rollout.window_size=null"], 2.0)],
                         ids=["recipe-sampler", "dance-sde-every-step"])
def test_dance_grpo(tmp_path, single_rank, task, overrides, steps):
    """⌊0.6·n⌋ of each sample's n stochastic steps: the recipe's 2-step window gives 1, Dance on all 4 steps 2."""
    done = _train(tmp_path, single_rank, task, "dance_grpo", *overrides)
    for m in done:
        assert m["trained_steps"] == steps and m["optimizer_steps"] == 1
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.numerics
@pytest.mark.parametrize("overrides", [[], ["lora.rank=4"]], ids=["full-frozen-copy-reference", "lora-adapters-off"])
def test_diffusion_dpo(tmp_path, single_rank, task, overrides):
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_dpo", *TINY, *overrides])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    assert len(done) == 2
    first = done[0]  # the policy is still the reference: every pair's margin is 0, the loss log 2
    assert first["dpo_pairs"] == 2 * (1 - first["zero_std_ratio"]) and first["optimizer_steps"] == 1
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["dpo_margin"] == 0.0
    assert first["grad_norm"] > 0
    assert "logprob_abs_diff" not in first  # no log-probs are trained on


@pytest.mark.numerics
def test_diffusion_nft(tmp_path, single_rank, task):
    """ODE rollouts; 8 samples x 2 timesteps = 16 rows, one optimizer step; LoRA (B = 0 at start) with the reference
    term: on the first step v_θ = v_old = v_ref, so the term is 0 and x̂0⁺ = x̂0⁻ (equal positive / negative parts
    when r = ½ on average)."""
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_nft", *TINY, "lora.rank=4",
                                                 "algorithm.diffusion_nft.timesteps_per_sample=2",
                                                 "algorithm.diffusion_nft.ref_weight=0.5"])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    assert len(done) == 2 and all(m["optimizer_steps"] == 1 and m["grad_norm"] > 0 for m in done)
    first = done[0]
    assert first["ref_loss"] == 0.0 and first["loss"] == first["policy_loss"]
    assert "logprob_abs_diff" not in first  # no log-probs recorded
    assert done[1]["ref_loss"] > 0  # the adapters moved


@pytest.mark.numerics
def test_diffusion_nft_ema_old_policy(tmp_path, single_rank, task):
    """old_policy=ema at decay 0 is the last update's weights, i.e. the copy: every metric equal to the copy run's;
    at decay 0.5 the first step is the copy's too (θ_ema = θ_0 = the rollout's), the second's v_old lags the
    rollout's weights, so its loss differs."""
    base = ["algorithm.name=diffusion_nft", *TINY, "algorithm.diffusion_nft.timesteps_per_sample=2"]
    runs = {}
    for label, extra in (("copy", []), ("ema0", ["algorithm.diffusion_nft.ema_decay=0"]),
                         ("ema5", ["algorithm.diffusion_nft.ema_decay=0.5"])):
        old = "copy" if label == "copy" else "ema"
        cfg = load_config("digits_flow_grpo", None, [*base, f"algorithm.diffusion_nft.old_policy={old}", *extra])
        train(cfg, single_rank, task, tmp_path / label)
        runs[label] = _metrics(tmp_path / label)
    assert runs["ema0"] == runs["copy"]
    assert runs["ema5"][0] == runs["copy"][0]
    assert runs["ema5"][1]["loss"] != runs["copy"][1]["loss"]
    assert runs["ema5"][1]["reward_mean"] == runs["copy"][1]["reward_mean"]  # the rollout is the policy's either way


@pytest.mark.numerics
def test_srpo(tmp_path, single_rank, task):
    """ODE rollouts; 8 samples x 2 rows = 16 rows, one optimizer step, the digit CNN's gradient through x̂0 with a
    negative prompt: r(x̂0 | its digit) − r(x̂0 | one)."""
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=srpo", *TINY,
                                                 "algorithm.srpo.negative_prompt=a handwritten digit one"])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    assert len(done) == 2 and all(m["optimizer_steps"] == 1 and m["grad_norm"] > 0 for m in done)
    for m in done:
        assert m["loss"] == pytest.approx(-m["srpo_relative"], rel=1e-6) and m["srpo_negative"] > 0
        assert m["srpo_relative"] == pytest.approx(m["srpo_reward"] - m["srpo_negative"], rel=1e-5, abs=1e-7)
        assert "logprob_abs_diff" not in m  # no log-probs recorded


def test_unknown_algorithm_lists_the_known_ones():
    with pytest.raises(ConfigError) as err:
        load_config("digits_flow_grpo", None, ["algorithm.name=ppo"])
    assert "unknown algorithm 'ppo'" in str(err.value)
    assert {"flow_grpo", "mix_grpo", "grpo_guard", "flow_dppo", "dance_grpo", "diffusion_dpo",
            "diffusion_nft", "srpo"} <= set(algorithm_names())
    for name in algorithm_names():
        assert repr(name) in str(err.value)


def _metrics(run_dir):
    """metrics.jsonl without what a clock measures."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items()
             if not k.endswith("_seconds") and k not in ("images_per_second", "tflops_per_second", "mfu")}
            for line in lines]


# "<algorithm>[:variant]" -> overrides
RESUMED = {"mix_grpo": ["algorithm.mix_grpo.window_mode=random"], "grpo_guard": [], "flow_dppo": [],
           "dance_grpo": [], "diffusion_dpo": [], "diffusion_nft": ["algorithm.diffusion_nft.timesteps_per_sample=2"],
           "diffusion_nft:ema": ["algorithm.diffusion_nft.timesteps_per_sample=2",
                                 "algorithm.diffusion_nft.old_policy=ema", "algorithm.diffusion_nft.ema_decay=0.5"],
           "srpo": []}


@pytest.mark.parametrize("case", sorted(RESUMED))
def test_killed_run_resumes_exactly(tmp_path, single_rank, task, case):
    """Every draw is seeded by (seed, step, index): killed after step 1 (checkpoint after step 0) and resumed, the
    run logs the uninterrupted run's metrics bit for bit (DiffusionNFT's EMA old policy: from the checkpoint)."""
    cfg = load_config("digits_flow_grpo", None, [f"algorithm.name={case.split(':')[0]}", *TINY, "train.steps=3",
                                                 "train.save_every=1", *RESUMED[case]])
    train(cfg, single_rank, task, tmp_path / "whole")
    train(cfg, single_rank, task, tmp_path / "killed", stop_after=2)
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "0"
    train(cfg, single_rank, task, tmp_path / "killed", resume=True)
    whole, resumed = _metrics(tmp_path / "whole"), _metrics(tmp_path / "killed")
    assert [m["step"] for m in resumed] == [0, 1, 2]
    assert resumed == whole  # rewards, losses, grad norms, the algorithm's own metrics: bit for bit
