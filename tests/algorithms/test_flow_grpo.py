"""The Flow-GRPO clipped loss, its metrics and both KL forms, against values computed by hand."""
import math

import pytest
import torch

from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig, flow_grpo_loss, kl_to_reference
from megatron_omni.rollout.samplers import sde_mean_std

EPS = 0.1  # a wide clip range keeps the hand arithmetic readable
# (ratio, advantage): inside the range; above it with A > 0 (clipped); below it with A > 0 (not clipped:
# the unclipped term is the larger); above it with A < 0 (not clipped); below it with A < 0 (clipped)
RATIOS = [1.05, 1.3, 0.8, 1.3, 0.8]
ADV = [1.0, 1.0, 1.0, -2.0, -2.0]
TERMS = [-1.05, -1.1, -0.8, 2.6, 1.8]  # max(-A·ρ, -A·clip(ρ, 0.9, 1.1)) per pair
GRAD_LOGP = [-1.05 / 5, 0.0, -0.8 / 5, 2.6 / 5, 0.0]  # d L / d log π: -A·ρ/B where unclipped, 0 where clipped


def _log_probs():
    old = torch.tensor([-1.2, 0.3, 2.0, -0.5, 0.0])
    new = (old + torch.tensor(RATIOS).log()).requires_grad_()
    return new, old


def test_clipped_loss_metrics_and_gradient():
    new, old = _log_probs()
    loss, m = flow_grpo_loss(new, old, torch.tensor(ADV), FlowGRPOLossConfig(clip_range=EPS))
    assert loss.item() == pytest.approx(sum(TERMS) / 5, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor(GRAD_LOGP), rtol=1e-6, atol=1e-7)
    assert m["clipfrac_above"].item() == pytest.approx(2 / 5) and m["clipfrac_below"].item() == pytest.approx(2 / 5)
    assert m["ratio_mean"].item() == pytest.approx(sum(RATIOS) / 5, rel=1e-6)
    mean = sum(RATIOS) / 5
    assert m["ratio_std"].item() == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in RATIOS) / 5), rel=1e-5)
    assert m["approx_kl"].item() == pytest.approx(0.5 * sum(math.log(r) ** 2 for r in RATIOS) / 5, rel=1e-5)
    assert m["kl"].item() == 0.0 and m["loss"].item() == m["policy_loss"].item() == loss.item()


def test_zero_advantage_gives_zero_loss_and_gradient():
    new, old = _log_probs()
    loss, _ = flow_grpo_loss(new, old, torch.zeros(5), FlowGRPOLossConfig(clip_range=EPS))
    loss.backward()
    assert loss.item() == 0.0 and not new.grad.any()


# means of two samples of three elements: (μ_θ − μ_ref)² averages 14/3 and 3; step std s = σ_t·sqrt(−Δ)
MEAN = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]])
STD, DT = torch.tensor([0.5, 1.0]), torch.tensor([-0.25, -0.04])
KL_EXACT = [(14 / 3) / (2 * 0.25), 3 / (2 * 1.0)]  # / (2 s²) = / (2 σ_t² (−Δ))
KL_FLOW_GRPO = [(14 / 3) / (2 * 1.0), 3 / (2 * 25.0)]  # / (2 σ_t²), σ_t² = s² / (−Δ) = 1 and 25


def test_kl_forms():
    ref = torch.zeros_like(MEAN)
    torch.testing.assert_close(kl_to_reference(MEAN, ref, STD, DT, "exact"), torch.tensor(KL_EXACT))
    torch.testing.assert_close(kl_to_reference(MEAN, ref, STD.view(2, 1), DT, "flow_grpo"), torch.tensor(KL_FLOW_GRPO))


def test_flow_grpo_kl_divides_by_the_sde_sigma_t():
    """With the sampler's own step std: t = 0.8, a = 0.7 → σ_t = 0.7·sqrt(0.8 / 0.2) = 1.4."""
    x, v = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    t, t_next = torch.tensor([0.8, 0.8]), torch.tensor([0.6, 0.6])
    mean, std = sde_mean_std(x, v, t, t_next, 0.7, 0.9)
    ref_mean = mean + 0.01
    torch.testing.assert_close(kl_to_reference(mean, ref_mean, std, t_next - t, "flow_grpo"),
                               torch.full((2,), 1e-4 / (2 * 1.4 ** 2)), rtol=1e-4, atol=0)
    torch.testing.assert_close(kl_to_reference(mean, ref_mean, std, t_next - t, "exact"),
                               torch.full((2,), 1e-4 / (2 * 1.4 ** 2 * 0.2)), rtol=1e-4, atol=0)


def test_kl_term_enters_the_loss_with_beta():
    new, old = _log_probs()
    adv = torch.tensor(ADV)
    mean = MEAN.repeat(3, 1)[:5]
    kw = dict(mean_BX=mean, ref_mean_BX=torch.zeros_like(mean), std_B=STD.repeat(3)[:5], dt_B=DT.repeat(3)[:5])
    cfg = FlowGRPOLossConfig(clip_range=EPS, kl_beta=0.5, kl_form="exact")
    loss, m = flow_grpo_loss(new, old, adv, cfg, **kw)
    kl = (KL_EXACT * 3)[:5]
    assert m["kl"].item() == pytest.approx(sum(kl) / 5, rel=1e-6)
    assert loss.item() == pytest.approx(sum(TERMS) / 5 + 0.5 * sum(kl) / 5, rel=1e-6)
    no_beta, m0 = flow_grpo_loss(new, old, adv, FlowGRPOLossConfig(clip_range=EPS, kl_form="exact"), **kw)
    assert no_beta.item() == pytest.approx(sum(TERMS) / 5, rel=1e-6) and m0["kl"].item() == m["kl"].item()


def test_errors_name_the_bad_value():
    new, old = _log_probs()
    with pytest.raises(ValueError, match=r"shapes \[\(5,\), \(5,\), \(4,\)\]"):
        flow_grpo_loss(new, old, torch.ones(4), FlowGRPOLossConfig(clip_range=EPS))
    with pytest.raises(ValueError, match=r"kl_beta=0.1 needs .* missing \['ref_mean_BX', 'std_B', 'dt_B'\]"):
        flow_grpo_loss(new, old, torch.ones(5), FlowGRPOLossConfig(clip_range=EPS, kl_beta=0.1), mean_BX=torch.zeros(5, 2))
    with pytest.raises(ValueError, match="kl_form 'gaussian' is not one of"):
        FlowGRPOLossConfig(clip_range=EPS, kl_form="gaussian")
    for bad in (0, 1.0):
        with pytest.raises(ValueError, match=f"clip_range must be > 0 and < 1; got {bad}"):
            FlowGRPOLossConfig(clip_range=bad)
    with pytest.raises(ValueError, match=r"std has shape \(3,\); expected a scalar or 2 values"):
        kl_to_reference(MEAN, MEAN, torch.ones(3), DT)
