"""MixGRPO's window schedule: progressive starts by hand (stride, period, wrap-around), seeded random starts
shared by every sample of a step, per-sample windows left to each request's seed, and the settings refused."""
from types import SimpleNamespace

import pytest

from megatron_omni.algorithms.mix_grpo import ALGORITHM as MIX, window_start
from megatron_omni.config import ConfigError, load_config
from megatron_omni.data.tasks import build_task


def test_progressive_starts_by_hand():
    assert [window_start("progressive", k, (0, 3)) for k in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert [window_start("progressive", k, (0, 3), period=2) for k in range(10)] == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    # range 1..4 (4 starts), stride 2: 1, 3, then back to 1
    assert [window_start("progressive", k, (1, 4), stride=2) for k in range(5)] == [1, 3, 1, 3, 1]


def test_random_starts_are_seeded_and_in_range():
    starts = [window_start("random", k, (2, 5), seed=7) for k in range(40)]
    assert starts == [window_start("random", k, (2, 5), seed=7) for k in range(40)]  # a resumed run draws the same
    assert set(starts) == {2, 3, 4, 5}
    assert starts != [window_start("random", k, (2, 5), seed=8) for k in range(40)]
    with pytest.raises(ValueError, match="window mode 'sliding'"):
        window_start("sliding", 0, (0, 1))


@pytest.fixture(scope="module")
def task():
    return build_task("digits")


def _run(task, overrides):
    """What ``requests`` reads of a run: its config, task and model family."""
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=mix_grpo", "rollout.prompts_per_step=2",
                                                 "rollout.group_size=3", *overrides])
    return SimpleNamespace(cfg=cfg, task=task, family=cfg.model.family_impl)


@pytest.mark.parametrize("mode", ["progressive", "random"])
def test_shared_window_on_every_request(task, mode):
    run = _run(task, [f"algorithm.mix_grpo.window_mode={mode}", "rollout.window_range=[1,5]", "algorithm.mix_grpo.stride=2"])
    for step in range(4):
        requests = MIX.requests(run, step)
        assert len(requests) == 6
        want = window_start(mode, step, (1, 5), stride=2, seed=run.cfg.train.seed)
        assert {r.window_start for r in requests} == {want}
        assert len({r.seed for r in requests}) == 6  # the samples' own noise is still their own


def test_per_sample_windows_are_drawn_by_each_request(task):
    run = _run(task, ["algorithm.mix_grpo.window_mode=random", "algorithm.mix_grpo.shared=false"])
    assert all(r.window_start is None for r in MIX.requests(run, 0))


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.mix_grpo.shared=false"], "algorithm.mix_grpo.shared: false draws a window per sample"),
    (["algorithm.mix_grpo.stride=0"], "algorithm.mix_grpo.stride: expected an integer >= 1"),
    (["rollout.window_size=null"], "algorithm.mix_grpo: trains an SDE window of rollout.window_size steps"),
    (["algorithm.mix_grpo.window_mode=sliding"], "algorithm.mix_grpo.window_mode: invalid choice 'sliding'"),
])
def test_bad_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("digits_flow_grpo", None, ["algorithm.name=mix_grpo", *overrides])
