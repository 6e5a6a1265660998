"""Sigma schedules (static shift) and the MixGRPO SDE window."""
import pytest
import torch

from megatron_omni.rollout.schedule import sde_window, shift_sigmas, sigmas


def test_sigmas_run_from_one_to_zero_in_float32():
    s = sigmas(10)
    assert s.dtype == torch.float32 and s.shape == (11,)
    assert s[0] == 1 and s[-1] == 0 and torch.all(s[1:] < s[:-1])
    torch.testing.assert_close(s, torch.linspace(1, 0, 11), rtol=0, atol=1e-7)


def test_shift_formula_by_hand():
    shift = 3.0
    base = torch.linspace(1, 0, 9, dtype=torch.float64)
    expected = (shift * base / (1 + (shift - 1) * base)).float()
    s = sigmas(8, shift)
    assert torch.equal(s, expected)
    assert s[0] == 1 and s[-1] == 0
    assert torch.all(s[1:-1] > base[1:-1].float())  # shift > 1 spends more steps at high noise


@pytest.mark.parametrize("args, match", [((0,), "num_steps=0"), ((2.5,), "num_steps=2.5"), ((4, 0.0), "shift=0.0")])
def test_bad_schedule_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        sigmas(*args)
    with pytest.raises(ValueError, match="shift=-1"):
        shift_sigmas(torch.ones(1), -1)


def test_window_mask_is_reproducible_from_a_seed():
    draws = [sde_window(10, 2, (0, 5), torch.Generator().manual_seed(s)) for s in range(20)]
    again = [sde_window(10, 2, (0, 5), torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(draws, again))
    starts = {start for _, start in draws}
    assert starts <= set(range(6)) and len(starts) > 1  # drawn from the whole inclusive range
    for mask, start in draws:
        assert mask.dtype == torch.bool and mask.sum() == 2 and mask[start] and mask[start + 1]


def test_window_with_given_start_and_bad_windows():
    mask, start = sde_window(6, 3, (0, 1), start=2)
    assert start == 2 and mask.tolist() == [False, False, True, True, True, False]
    with pytest.raises(ValueError, match=r"start range \(0, 5\)"):
        sde_window(6, 3, (0, 5))
    with pytest.raises(ValueError, match="window size 7"):
        sde_window(6, 7)
    with pytest.raises(ValueError, match="start=4"):
        sde_window(6, 3, start=4)
