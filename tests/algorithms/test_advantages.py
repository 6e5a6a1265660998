"""Group advantages by hand: global / per-group / no std, clipping, zero-std groups counted and dropped."""
import math

import pytest
import torch

from megatron_omni.algorithms.advantages import group_advantages

# three prompts with non-contiguous ids, samples interleaved: prompt 7 -> [1, 2, 3], 3 -> [5, 5, 5], 9 -> [0, 4]
REWARDS = torch.tensor([1.0, 5.0, 0.0, 2.0, 5.0, 4.0, 3.0, 5.0])
IDS = torch.tensor([7, 3, 9, 7, 3, 9, 7, 3])
CENTRED = [-1.0, 0.0, -2.0, 0.0, 0.0, 2.0, 1.0, 0.0]  # r - mean of its prompt's rewards
GLOBAL_STD = math.sqrt(105 / 8 - (25 / 8) ** 2)  # population std of all eight rewards


def _close(actual: torch.Tensor, expected: list[float]):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_global_std_is_the_default():
    out = group_advantages(REWARDS, IDS)
    _close(out.advantages, [c / (GLOBAL_STD + 1e-4) for c in CENTRED])
    assert out.num_groups == 3 and out.zero_std_ratio == pytest.approx(1 / 3)
    assert out.keep.all()


def test_group_std_and_no_std():
    std_of = {0: math.sqrt(2 / 3), 1: 0.0, 2: 2.0}  # population std of prompt 7, 3, 9
    group = [0, 1, 2, 0, 1, 2, 0, 1]
    _close(group_advantages(REWARDS, IDS, std="group").advantages,
           [c / (std_of[g] + 1e-4) for c, g in zip(CENTRED, group)])
    _close(group_advantages(REWARDS, IDS, std="none").advantages, CENTRED)


def test_clip_and_drop_zero_std_groups():
    out = group_advantages(REWARDS, IDS, std="none", clip_max=1.5, drop_zero_std=True)
    _close(out.advantages, [-1.0, 0.0, -1.5, 0.0, 0.0, 1.5, 1.0, 0.0])
    assert out.keep.tolist() == [True, False, True, True, False, True, True, False]
    assert out.zero_std_ratio == pytest.approx(1 / 3)


def test_all_equal_group_is_exactly_zero_whatever_the_rounding():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2])  # the mean of three 0.1s need not be exactly 0.1
    out = group_advantages(r, torch.tensor([0, 0, 0, 1, 1]), std="group")
    assert out.advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert out.zero_std_ratio == 0.5
    single = group_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 1]))  # groups of one: no signal
    assert single.advantages.tolist() == [0.0, 0.0] and single.zero_std_ratio == 1.0


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="std mode 'batch' is not one of"):
        group_advantages(REWARDS, IDS, std="batch")
    with pytest.raises(ValueError, match=r"rewards have shape \(8,\) and group ids \(7,\)"):
        group_advantages(REWARDS, IDS[:7])
    with pytest.raises(ValueError, match=r"non-finite values: \[nan\]"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="A_max must be > 0; got 0"):
        group_advantages(REWARDS, IDS, clip_max=0)
