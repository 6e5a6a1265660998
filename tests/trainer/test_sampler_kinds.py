"""Every stochastic sampler through the FlowGRPO loop: the trainer scores each recorded step with the kind and
log-prob form that sampled it (in the loss, the KL term and the consistency check), so on the CPU in float32 the
rollout's log-probs are re-computed to rounding and the first optimizer step's ratio is 1."""
import pytest

from megatron_omni.config import load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.trainer.loop import train

pytestmark = pytest.mark.numerics

# 2 prompts x 4 samples x a 2-step window = 16 pairs = one optimizer step per RL step, so the logged ratio is the
# first optimizer step's (weights still the rollout's); the window stays off CPS's deterministic last step
TINY = ["train.steps=2", "train.save_every=0", "train.micro_batch_size=8", "train.global_batch_size=16",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "rollout.window_range=[0,1]", "algorithm.logprob_check_samples=8", "logging.wandb_mode=disabled",
        "model.arch.num_layers=2", "algorithm.kl_beta=0.01"]
KINDS = [("sde", "gaussian"), ("cps", "gaussian"), ("cps", "simple"), ("dance", "gaussian")]


@pytest.fixture(scope="module")
def task():
    return build_task("digits")


@pytest.mark.parametrize("sampler,form", KINDS, ids=[f"{s}-{f}" for s, f in KINDS])
def test_trainer_scores_each_kind_as_sampled(tmp_path, single_rank, task, sampler, form):
    cfg = load_config("digits_flow_grpo", None, TINY + [f"rollout.sampler={sampler}", f"rollout.log_prob_form={form}"])
    _, done = train(cfg, single_rank, task, tmp_path / "run")
    assert len(done) == 2 and done[0]["optimizer_steps"] == 1
    for m in done:
        # the same float32 formula on the same velocities, batch shapes apart: rounding only (an SDE log-prob
        # applied to a CPS step was off by 0.41)
        assert m["logprob_abs_diff"] <= 1e-6, (sampler, form, m["logprob_abs_diff"])
        assert m["logprob_pearson"] > 0.9999
        # log-prob deviations ~1e-7 give ratios within ~1e-6 of 1: nothing is clipped at eps 1e-3
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert m["clipfrac_below"] == 0.0 and m["clipfrac_above"] == 0.0
        assert m["kl"] >= 0 and m["grad_norm"] > 0


def test_simple_form_only_with_cps():
    from megatron_omni.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.log_prob_form: 'simple' is the CPS references' form"):
        load_config("digits_flow_grpo", None, ["rollout.sampler=sde", "rollout.log_prob_form=simple"])
