"""Flow-DPPO's loss against docs/algorithms.md's formulas worked by hand: no clipping, a pair masked only when its
Gaussian KL to the old step reaches the threshold and it moves further away, on both sides of A."""
import math

import pytest
import torch

from megatron_omni.algorithms.flow_dppo.loss import FlowDPPOLossConfig, flow_dppo_loss

pytestmark = pytest.mark.numerics
TAU = 1e-2
STD = 0.5

# (log π_θ − log π_old, A, μ_θ − μ_old per element), and whether the pair is masked
CASES = [
    (0.4, 1.0, (0.1, 0.1), True),     # KL 0.02 >= τ, ρ > 1 with A > 0: further away, masked
    (-0.4, 1.0, (0.1, 0.1), False),   # KL >= τ but ρ < 1 with A > 0: moves back, kept
    (0.4, 1.0, (0.05, 0.0), False),   # KL 0.0025 < τ: inside the trust region, kept
    (-0.3, -2.0, (0.0, 0.2), True),   # KL 0.04 >= τ, ρ < 1 with A < 0: further away, masked
    (0.3, -2.0, (0.0, 0.2), False),   # KL >= τ, ρ > 1 with A < 0: moves back, kept
    (2.0, 0.5, (0.0, 0.0), False),    # a large ratio, KL 0: no clip, kept whole
]


def _hand_kl(delta):
    return sum(d * d for d in delta) / len(delta) / (2 * STD * STD)


def test_mask_and_loss_match_hand_values():
    log_ratio = torch.tensor([c[0] for c in CASES], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([c[1] for c in CASES])
    old_mean = torch.zeros(len(CASES), 2)
    mean = torch.tensor([c[2] for c in CASES])
    n = len(CASES)
    loss, metrics = flow_dppo_loss(log_ratio, torch.zeros(n), adv, mean, old_mean, torch.full((n,), STD),
                                   torch.full((n,), -0.2), FlowDPPOLossConfig(kl_threshold=TAU))
    loss.backward()
    masked = [(_hand_kl(c[2]) >= TAU) and ((c[0] > 0 and c[1] > 0) or (c[0] < 0 and c[1] < 0)) for c in CASES]
    assert masked == [c[3] for c in CASES]  # the table's reasons agree with the formula
    want = sum(0.0 if m else -c[1] * math.exp(c[0]) for c, m in zip(CASES, masked)) / n
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert metrics["masked_frac"].item() == pytest.approx(sum(masked) / n)
    assert metrics["old_kl"].item() == pytest.approx(sum(_hand_kl(c[2]) for c in CASES) / n, rel=1e-6)
    for i, (c, m) in enumerate(zip(CASES, masked)):  # unclipped: dL/dlog π_i = −A_i·ρ_i / n unless masked
        assert log_ratio.grad[i].item() == pytest.approx(0.0 if m else -c[1] * math.exp(c[0]) / n, rel=1e-6)


def test_threshold_is_a_setting():
    with pytest.raises(ValueError, match="kl_threshold must be > 0"):
        FlowDPPOLossConfig(kl_threshold=0.0)
    # a threshold above every pair's KL masks nothing
    n = len(CASES)
    _, metrics = flow_dppo_loss(torch.tensor([c[0] for c in CASES]), torch.zeros(n), torch.tensor([c[1] for c in CASES]),
                                torch.tensor([c[2] for c in CASES]), torch.zeros(n, 2), torch.full((n,), STD),
                                torch.full((n,), -0.2), FlowDPPOLossConfig(kl_threshold=1.0))
    assert metrics["masked_frac"].item() == 0.0
