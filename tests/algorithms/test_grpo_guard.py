"""GRPO-Guard's loss against docs/algorithms.md's formulas worked by hand: the bias-corrected, rescaled ratio,
the clip on both sides, and the per-step reweighting 1 / (−Δ)."""
import math

import pytest
import torch

from megatron_omni.algorithms.flow_grpo.loss import FlowGRPOLossConfig
from megatron_omni.algorithms.grpo_guard.loss import grpo_guard_loss

pytestmark = pytest.mark.numerics
EPS = 0.05


def _hand(log_prob, old_log_prob, adv, mean, old_mean, sigma, dt):
    """docs/algorithms.md for pairs that share one step: s = mean(σ_t)·mean(sqrt(−Δ)); b = mean (μ_θ − μ_old)²/(2s²);
    ρ = exp((Δlog π + b)·s); L = mean max(−Aρ, −A·clip(ρ)) / mean(sqrt(−Δ))²  (plain Python floats)."""
    n = len(log_prob)
    root = sum(math.sqrt(-d) for d in dt) / n
    s = sum(sigma) / n * root
    terms, rhos = [], []
    for i in range(n):
        b = sum((m - o) ** 2 for m, o in zip(mean[i], old_mean[i])) / len(mean[i]) / (2 * s * s)
        rho = math.exp((log_prob[i] - old_log_prob[i] + b) * s)
        rhos.append(rho)
        terms.append(max(-adv[i] * rho, -adv[i] * min(max(rho, 1 - EPS), 1 + EPS)))
    return sum(terms) / n / root ** 2, rhos


def _inputs(dt_value=-0.25, sigma_value=0.8):
    # four pairs at one step: A > 0 clipped above, A > 0 inside, A < 0 clipped below, A < 0 inside
    log_prob = [0.9, 0.02, -0.6, -0.05]
    old_log_prob = [0.1, 0.0, 0.2, 0.0]
    adv = [1.5, 0.7, -1.2, -0.4]
    mean = [[0.3, -0.2], [0.1, 0.0], [0.5, 0.5], [-0.1, 0.2]]
    old_mean = [[0.25, -0.1], [0.1, 0.05], [0.4, 0.45], [-0.1, 0.25]]
    sigma = [sigma_value] * 4
    dt = [dt_value] * 4
    return log_prob, old_log_prob, adv, mean, old_mean, sigma, dt


def _run(log_prob, old_log_prob, adv, mean, old_mean, sigma, dt):
    lp = torch.tensor(log_prob, dtype=torch.float64, requires_grad=True)
    std = torch.tensor(sigma, dtype=torch.float64) * torch.tensor(dt, dtype=torch.float64).neg().sqrt()
    loss, metrics = grpo_guard_loss(lp, torch.tensor(old_log_prob), torch.tensor(adv), torch.tensor(mean),
                                    torch.tensor(old_mean), std, torch.tensor(dt), FlowGRPOLossConfig(clip_range=EPS))
    loss.backward()
    return loss, metrics, lp.grad


def test_loss_and_clip_both_ways_match_hand_values():
    args = _inputs()
    want, rhos = _hand(*args)
    loss, metrics, grad = _run(*args)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert rhos[0] > 1 + EPS and rhos[2] < 1 - EPS and all(abs(r - 1) < EPS for r in rhos[1::2])
    assert metrics["clipfrac_above"].item() == 0.25 and metrics["clipfrac_below"].item() == 0.25
    assert metrics["ratio_mean"].item() == pytest.approx(sum(rhos) / 4, rel=1e-6)
    # clipped pairs carry no gradient; inside the range dL/dlog π_i = −A_i·ρ_i·s / (n·(−Δ))
    s = 0.8 * 0.5
    assert grad[0].item() == 0.0 and grad[2].item() == 0.0
    for i in (1, 3):
        assert grad[i].item() == pytest.approx(-args[2][i] * rhos[i] * s / (4 * 0.25), rel=1e-6)


def test_bias_correction_and_step_weight():
    log_prob, old_log_prob, adv, mean, old_mean, sigma, dt = _inputs()
    loss_near, metrics, _ = _run(log_prob, old_log_prob, adv, mean, old_mean, sigma, dt)
    # b_i = mean (μ_θ − μ_old)² / (2 s²) with s = 0.4: pair 0 moved by (0.05, −0.1)
    assert metrics["mean_bias"].item() == pytest.approx(
        sum(sum((m - o) ** 2 for m, o in zip(a, b)) / 2 / (2 * 0.16) for a, b in zip(mean, old_mean)) / 4, rel=1e-6)
    # with the means equal there is no bias: ρ = exp(Δlog π·s)
    _, metrics0, _ = _run(log_prob, old_log_prob, adv, mean, mean, sigma, dt)
    assert metrics0["mean_bias"].item() == 0.0
    assert metrics0["ratio_mean"].item() == pytest.approx(
        sum(math.exp((a - b) * 0.4) for a, b in zip(log_prob, old_log_prob)) / 4, rel=1e-6)
    # a step 4x as long: s doubles at the same σ_t, and the loss is divided by (−Δ) = 1 instead of 0.25
    args_long = _inputs(dt_value=-1.0)
    want, _ = _hand(*args_long)
    assert _run(*args_long)[0].item() == pytest.approx(want, rel=1e-6)
    assert want != pytest.approx(loss_near.item(), rel=1e-2)


def test_mixed_steps_are_corrected_per_pair():
    """Pairs at two different steps: each pair's own s and (−Δ), i.e. the hand formula on each pair alone."""
    log_prob, old_log_prob, adv, mean, old_mean, _, _ = _inputs()
    sigma, dt = [0.8, 0.8, 1.3, 1.3], [-0.25, -0.25, -0.1, -0.1]
    loss, _, _ = _run(log_prob, old_log_prob, adv, mean, old_mean, sigma, dt)
    per_pair = [_hand(*[[v[i]] for v in (log_prob, old_log_prob, adv, mean, old_mean, sigma, dt)])[0]
                for i in range(4)]
    assert loss.item() == pytest.approx(sum(per_pair) / 4, rel=1e-6)
