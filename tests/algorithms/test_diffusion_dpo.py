"""Online Diffusion-DPO: the loss and its gradients by hand (pairs on both sides of the margin), best / worst pairs
per group (ties, a group without preference), the pairs' shared noise and timestep, and the loss inside megatron's
forward_backward_func against the adapters-off reference (its errors from a forward-only pass of the schedule) equal
to plain autograd."""
import math
from dataclasses import replace

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_omni.algorithms.diffusion_dpo import (ALGORITHM as DPO, best_worst_pairs, diffusion_dpo_loss,
                                                    dpo_microbatches, pair_noise)
from megatron_omni.config import ConfigError, load_config
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.rollout.engine import Request, Trajectory
from model_specs.common.lora import disable_adapters
from tests.algorithms.models import lora_model
from tests.qwen_image_reference import rel_err, tiny_config

BETA = 50.0


@pytest.mark.numerics
def test_loss_and_gradients_by_hand():
    # pair 0: the winner's error fell more than the loser's (margin > 0); pair 1: the other way (margin < 0).
    # The loss runs in float32: 1e-5 relative
    e_w, e_l, r_w, r_l = [0.50, 0.80], [0.90, 0.70], [0.52, 0.78], [0.89, 0.72]
    err = torch.tensor(e_w + e_l, dtype=torch.float64, requires_grad=True)
    loss, metrics = diffusion_dpo_loss(err, torch.tensor(r_w + r_l), BETA)
    loss.backward()
    margins = [-0.5 * BETA * ((e_w[k] - r_w[k]) - (e_l[k] - r_l[k])) for k in range(2)]
    assert margins[0] > 0 > margins[1]
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / 2, rel=1e-5)
    assert metrics["dpo_accuracy"].item() == 0.5
    assert metrics["dpo_margin"].item() == pytest.approx(sum(margins) / 2, abs=1e-5)
    for k, m in enumerate(margins):  # dL/de_w = ½β·σ(−m)/B, dL/de_l = −½β·σ(−m)/B
        s = 1 / (1 + math.exp(m))
        assert err.grad[k].item() == pytest.approx(0.5 * BETA * s / 2, rel=1e-5)
        assert err.grad[2 + k].item() == pytest.approx(-0.5 * BETA * s / 2, rel=1e-5)
    with pytest.raises(ValueError, match=r"expected two equal \[2B\]"):
        diffusion_dpo_loss(torch.zeros(3), torch.zeros(3), BETA)


def test_best_and_worst_per_group():
    rewards = [0.2, 0.9, 0.9, 0.1, 0.5, 0.5, 0.5, 0.3, 0.8]
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 2]
    pairs = best_worst_pairs(rewards, groups)
    assert (pairs.winners, pairs.losers) == ([1, 8], [3, 7])  # the first of equal winners; group 1 has none
    assert pairs.zero_std_ratio == pytest.approx(1 / 3)


def _traj(seed, prompt, x0):
    return Trajectory(Request(prompt=prompt, seed=seed, img_fhw=(1, 2, 2)), torch.stack([torch.zeros_like(x0), x0]),
                      torch.tensor([1.0, 0.0]), torch.zeros(1), torch.zeros(1, dtype=torch.bool))


@pytest.mark.numerics
def test_pairs_share_noise_and_timestep():
    g = torch.Generator().manual_seed(0)
    trajs = [_traj(10 + i, f"p{i // 2}", torch.randn(4, 3, generator=g)) for i in range(4)]
    text = {"p0": (torch.randn(3, 8), None), "p1": (torch.randn(2, 8), None)}
    mb, = dpo_microbatches(trajs, [1, 2], [0, 3], text, size=2)
    for k, (w, l) in enumerate([(1, 0), (2, 3)]):
        eps, t = pair_noise(trajs[w])
        assert mb.t[k] == t and mb.t[2 + k] == t  # the loser takes its winner's t and ε
        for row, i in ((k, w), (2 + k, l)):
            x0 = trajs[i].final_sample
            assert torch.allclose(mb.x_t[row], (1 - t) * x0 + t * eps, atol=1e-7)
            assert torch.equal(mb.target[row], eps - x0)
    assert mb.txt.shape == (4, 3, 8) and mb.txt_mask[1].tolist() == [True, True, False]  # p1 padded, masked
    assert torch.equal(pair_noise(trajs[1])[0], pair_noise(trajs[1])[0])  # seeded: a resume trains the same


@pytest.mark.numerics
def test_loss_in_forward_backward_matches_plain_autograd(single_rank):
    arch = tiny_config()
    model = lora_model(arch, single_rank.tp_group)
    g = torch.Generator().manual_seed(1)
    trajs = [Trajectory(Request(prompt=f"p{i // 4}", seed=i, img_fhw=(1, 4, 4)),
                        torch.randn(2, 16, arch.in_channels, generator=g, dtype=torch.float64),
                        torch.tensor([1.0, 0.0]), torch.zeros(1), torch.zeros(1, dtype=torch.bool)) for i in range(8)]
    text = {f"p{k}": (torch.randn(5 - k, arch.joint_attention_dim, generator=g, dtype=torch.float64), None)
            for k in range(2)}
    mbs = dpo_microbatches(trajs, [0, 5, 2], [3, 4, 7], text, size=2)  # a micro-batch of 2 pairs, then one of 1
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_dpo", f"algorithm.diffusion_dpo.beta={BETA}"])
    forward_step = DPO.forward_step(cfg, None)
    with cuda_factories_on_cpu(), disable_adapters(model):  # the reference's pass (with_reference_errors' schedule)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
            seq_length=1, micro_batch_size=2, forward_only=True, collect_non_loss_data=True)
    mbs = [replace(mb, ref_error=o["error"]) for mb, o in zip(mbs, out)]
    model.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=2)
    megatron = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    losses = []
    # by hand: e = mean (v − (ε − x0))², the reference with the adapters off; each mean reduced as the library
    # reduces it (flattened, one float32 mean per row): e − r cancels to ~1e-3 of e, and β/2 = 25 scales it, so a
    # mean summed in another order (~1e-7 of e, kernels differ between CPUs) moves a gradient by ~1e-5
    def error(v, target):
        return (v.float() - target.float()).pow(2).flatten(1).mean(1)

    for mb in mbs:
        e = error(model(mb.x_t.double(), mb.txt.double(), mb.t, mb.img_fhw, mb.txt_mask), mb.target)
        with torch.no_grad(), disable_adapters(model):
            r = error(model(mb.x_t.double(), mb.txt.double(), mb.t, mb.img_fhw, mb.txt_mask), mb.target)
        b = e.shape[0] // 2
        margin = -0.5 * BETA * ((e[:b] - r[:b]) - (e[b:] - r[b:]))
        losses.append(-torch.nn.functional.logsigmoid(margin).mean())
    (sum(losses) / len(mbs)).backward()
    errs = {n: rel_err(megatron[n], p.grad) for n, p in model.named_parameters() if p.requires_grad}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-6, (worst, errs[worst])
    assert sum(p.grad.norm() for p in model.parameters() if p.requires_grad) > 0
    for m, loss in zip(metrics, losses):
        # (megatron's loss is the same float32 math; a wrong sign or a missing reference moves it by ~1)
        assert m["loss"].item() == pytest.approx(loss.item(), rel=1e-4)


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="algorithm.diffusion_dpo.beta: expected > 0"):
        load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_dpo", "algorithm.diffusion_dpo.beta=0"])
