"""DanceGRPO: the Dance-SDE step the trainer scores with, by hand; the trained share of each sample's steps (both
ends of the fraction, seeded, its uncond outputs kept in step); a group's shared initial noise through the engine;
and its clipped loss on Dance steps inside megatron's forward_backward_func equal to plain autograd."""
import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_omni.algorithms.dance_grpo import ALGORITHM as DANCE, trained_subset
from megatron_omni.algorithms.flow_grpo.step import (FlowGRPOMicroBatch, guided_velocity, model_output,
                                                     step_log_prob, step_mean)
from megatron_omni.config import ConfigError, load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request, Trajectory
from tests.qwen_image_reference import diffusers_reference, megatron_from_reference, rel_err, tiny_config

FHW = (1, 4, 4)
ETA = 0.8


def _mb(x, v_unused=None, t=0.6, t_next=0.4, b=1, channels=1, **kw):
    return FlowGRPOMicroBatch(x_t=x, txt=torch.zeros(b, 1, 1), txt_mask=None, img_fhw=(1, 1, channels),
                              x_next=torch.zeros_like(x), t=torch.full((b,), t), t_next=torch.full((b,), t_next),
                              old_log_prob=torch.zeros(b), advantage=torch.ones(b), noise_level=ETA, sigma_1=0.9,
                              sampler="dance", **kw)


@pytest.mark.numerics
def test_dance_step_by_hand():
    """μ = x + Δ·v − ½η²·s·Δ with s = −(x − (1 − t)·x̂0)/t², x̂0 = x − t·v; std = η·sqrt(−Δ)."""
    x, v, t, tn = 0.5, -1.25, 0.6, 0.4
    dt, x0 = tn - t, x - t * v
    score = -(x - (1 - t) * x0) / t ** 2
    mean, std = x + dt * v - 0.5 * ETA ** 2 * score * dt, ETA * math.sqrt(-dt)
    x_next = 0.3
    lp = -(x_next - mean) ** 2 / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    mb = _mb(torch.tensor([[[x]]]))
    mb.x_next = torch.tensor([[[x_next]]])
    got_mean, got_lp, got_std = step_log_prob(torch.tensor([[[v]]]), mb)
    assert got_mean.item() == pytest.approx(mean, rel=1e-6)
    assert got_std.item() == pytest.approx(std, rel=1e-6)
    assert got_lp.item() == pytest.approx(lp, rel=1e-6)


def _traj(trained_steps, n=10, seed=3, uncond=True):
    trained = torch.zeros(n, dtype=torch.bool)
    trained[list(trained_steps)] = True
    k = len(trained_steps)
    rows = torch.tensor(trained_steps, dtype=torch.float32).view(k, 1, 1).expand(k, 2, 1) if uncond else None
    return Trajectory(Request(seed=seed), torch.zeros(n + 1, 2, 1), torch.linspace(1, 0, n + 1), torch.zeros(n),
                      trained, uncond_velocity=rows)


@pytest.mark.parametrize("fraction,count", [(0.6, 3), (1.0, 6), (0.01, 1)])
def test_trained_subset_share(fraction, count):
    traj = _traj([1, 2, 3, 5, 8, 9])
    sub = trained_subset(traj, fraction)
    steps = torch.nonzero(sub.trained).flatten().tolist()
    assert len(steps) == count and set(steps) <= {1, 2, 3, 5, 8, 9}  # ⌊τ·6⌋, at least 1
    assert sub.uncond_velocity[:, 0, 0].tolist() == steps  # each kept uncond output is its own step's
    assert torch.equal(sub.trained, trained_subset(traj, fraction).trained)  # seeded: a resume trains the same
    assert traj.trained.sum() == 6  # the rollout's record is left whole


def test_trained_subset_differs_by_sample():
    picks = {tuple(torch.nonzero(trained_subset(_traj(range(10), seed=s, uncond=False), 0.3).trained).flatten()
                   .tolist()) for s in range(8)}
    assert len(picks) > 1


def test_requests_share_noise_by_group():
    task = build_task("digits")
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=dance_grpo", "rollout.prompts_per_step=3",
                                                 "rollout.group_size=4"])
    run = SimpleNamespace(cfg=cfg, task=task, family=cfg.model.family_impl)
    reqs = DANCE.requests(run, 5)
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.prompt_id, set()).add(r.noise_seed)
    assert len(by_group) == 3 and all(len(s) == 1 for s in by_group.values())
    assert len({next(iter(s)) for s in by_group.values()}) == 3 and len({r.seed for r in reqs}) == 12
    cfg.algorithm.dance_grpo.shared_noise = False
    assert all(r.noise_seed is None for r in DANCE.requests(run, 5))
    with pytest.raises(ConfigError, match="algorithm.dance_grpo.timestep_fraction: expected a share in"):
        load_config("digits_flow_grpo", None, ["algorithm.name=dance_grpo", "algorithm.dance_grpo.timestep_fraction=0"])


@pytest.fixture(scope="module")
def model(single_rank):
    arch = tiny_config()
    return arch, megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)


@pytest.mark.numerics
def test_engine_group_shares_initial_noise_only(model):
    arch, net = model
    emb = torch.randn(3, arch.joint_attention_dim, generator=torch.Generator().manual_seed(0))
    common = dict(prompt_emb=emb, img_fhw=FHW, num_steps=4, sampler="dance", noise_level=ETA)
    reqs = [Request(prompt_id=i // 2, seed=10 + i, noise_seed=99 + i // 2, **common) for i in range(4)]
    trajs = EmbeddedEngine(net, arch, None, EngineConfig(max_num_seqs=4)).generate(reqs)
    assert torch.equal(trajs[0].latents[0], trajs[1].latents[0]) and torch.equal(trajs[2].latents[0], trajs[3].latents[0])
    assert not torch.equal(trajs[0].latents[0], trajs[2].latents[0])
    assert not torch.equal(trajs[0].final_sample, trajs[1].final_sample)  # each sample's step noise is its own
    flipped = EmbeddedEngine(net, arch, None, EngineConfig(max_num_seqs=4)).generate(reqs[::-1])
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(flipped[::-1], trajs))  # the batch's order: no matter


@pytest.mark.numerics
def test_dance_steps_in_forward_backward_match_plain_autograd(model):
    arch, net = model
    g = torch.Generator().manual_seed(2)
    n_img, mbs, eps = FHW[0] * FHW[1] * FHW[2], [], 1e-4
    for i in range(2):
        t = torch.rand(2, generator=g) * 0.6 + 0.3
        mb = FlowGRPOMicroBatch(
            x_t=torch.randn(2, n_img, arch.in_channels, generator=g), txt=torch.randn(2, 5, arch.joint_attention_dim,
                                                                                      generator=g),
            txt_mask=None, img_fhw=FHW, x_next=torch.zeros(2, n_img, arch.in_channels), t=t, t_next=t - 0.2,
            old_log_prob=torch.zeros(2), advantage=torch.tensor([1.1, -0.7]), noise_level=ETA, sigma_1=0.9,
            sampler="dance")
        with torch.no_grad():
            mean, std = step_mean(guided_velocity(model_output(net, mb), mb), mb)
            mb.x_next = mean + std * torch.randn(mean.shape, generator=g)
            lp = step_log_prob(guided_velocity(model_output(net, mb), mb), mb)[1]
        mb.old_log_prob = lp + torch.tensor([3e-4, -2e-5]) * (1 - 2 * i)  # clipped on one side, inside on the other
        mbs.append(mb)
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=dance_grpo", f"algorithm.clip_range={eps}"])
    net.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        get_forward_backward_func()(forward_step_func=DANCE.forward_step(cfg, None), data_iterator=iter(mbs),
                                    model=net, num_microbatches=2, seq_length=1, micro_batch_size=2)
    megatron = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    losses = []
    for mb in mbs:  # docs/algorithms.md by hand: the Dance-SDE log-prob, then the clipped loss
        x, t, dt = mb.x_t, mb.t.view(-1, 1, 1), (mb.t_next - mb.t).view(-1, 1, 1)
        v = net(mb.x_t, mb.txt, mb.t, FHW, None).float()
        score = -(x - (1 - t) * (x - t * v)) / t ** 2
        eta = torch.tensor(ETA)  # float32, as the sampler holds the noise level
        mean, std = x + v * dt - 0.5 * eta ** 2 * score * dt, eta * torch.sqrt(-dt)
        lp = (-(mb.x_next - mean) ** 2 / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean((1, 2))
        ratio, a = torch.exp(lp - mb.old_log_prob), mb.advantage
        losses.append(torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps)).mean())
    (sum(losses) / 2).backward()
    errs = {n: rel_err(megatron[n], p.grad) for n, p in net.named_parameters()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-6, (worst, errs[worst])
    assert sum(p.grad.norm() for p in net.parameters()) > 0
