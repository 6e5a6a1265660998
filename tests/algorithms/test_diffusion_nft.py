"""DiffusionNFT: the loss and its gradient by hand (a better and a worse sample, A beyond A_max, the weight floor),
the training rows drawn from the schedule, and the loss inside megatron's forward_backward_func (LoRA, the
reference term on) equal to plain autograd."""

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_omni.algorithms.diffusion_nft import (ALGORITHM as NFT, NFTLossConfig, diffusion_nft_loss,
                                                    nft_microbatches, training_rows)
from megatron_omni.config import ConfigError, load_config
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.rollout.engine import Request, Trajectory
from model_specs.common.lora import disable_adapters
from tests.algorithms.models import lora_model
from tests.qwen_image_reference import rel_err, tiny_config

pytestmark = pytest.mark.numerics
BETA, A_MAX = 0.5, 2.0


def _hand(v, old, x_t, x0, t, adv):
    """docs/algorithms.md in plain floats, per row then averaged."""
    total = 0.0
    for i in range(len(v)):
        r = 0.5 + 0.5 * min(max(adv[i] / A_MAX, -1), 1)
        pos = [x_t[i][e] - t[i] * (BETA * v[i][e] + (1 - BETA) * old[i][e]) - x0[i][e] for e in range(len(v[i]))]
        neg = [x_t[i][e] - t[i] * ((1 + BETA) * old[i][e] - BETA * v[i][e]) - x0[i][e] for e in range(len(v[i]))]
        w_pos = max(sum(abs(d) for d in pos) / len(pos), 1e-5)
        w_neg = max(sum(abs(d) for d in neg) / len(neg), 1e-5)
        total += r * sum(d * d for d in pos) / len(pos) / w_pos + (1 - r) * sum(d * d for d in neg) / len(neg) / w_neg
    return A_MAX * total / len(v) / BETA


def test_loss_by_hand():
    v = [[0.3, -0.2], [1.0, 0.5], [0.2, 0.2]]
    old = [[0.1, -0.1], [0.8, 0.9], [0.2, 0.2]]
    x_t = [[0.5, 0.4], [-0.3, 0.2], [0.7, 0.1]]
    x0 = [[0.4, 0.5], [-0.6, -0.1], [0.62, 0.02]]  # row 2: x_t − t·v = x0 exactly, both weights at the floor
    t = [0.6, 0.3, 0.4]
    adv = [1.0, -0.5, 7.0]  # better, worse, beyond A_max (r = 1)
    loss, metrics = diffusion_nft_loss(*(torch.tensor(a, dtype=torch.float64) for a in (v, old, x_t, x0, t, adv)),
                                       NFTLossConfig(beta=BETA, adv_clip_max=A_MAX))
    assert loss.item() == pytest.approx(_hand(v, old, x_t, x0, t, adv), rel=1e-5)
    assert metrics["optimality"].item() == pytest.approx((0.75 + 0.375 + 1.0) / 3, rel=1e-6)
    assert metrics["ref_loss"].item() == 0.0 and metrics["policy_loss"].item() == metrics["loss"].item()


@pytest.mark.parametrize("adv,sign", [(5.0, 1), (-5.0, -1)], ids=["better", "worse"])
def test_gradient_at_the_old_policy(adv, sign):
    """At v_θ = v_old both x̂0 are x_t − t·v_old = x0 + d: r = 1 gives dL/dv = −A_max·2t·d/(w·n) (v⁺ pulled to
    reconstruct x0), r = 0 the opposite (v⁻ pulled, so v_θ pushed away)."""
    old = torch.tensor([[0.4, -0.3]], dtype=torch.float64)
    v = old.clone().requires_grad_(True)
    x_t, t, x0 = torch.tensor([[0.2, 0.1]], dtype=torch.float64), torch.tensor([0.5]), torch.tensor([[0.1, 0.3]])
    loss, _ = diffusion_nft_loss(v, old, x_t, x0, t, torch.tensor([adv]), NFTLossConfig(beta=BETA, adv_clip_max=A_MAX))
    loss.backward()
    d = [0.2 - 0.5 * 0.4 - 0.1, 0.1 + 0.5 * 0.3 - 0.3]
    w = sum(abs(x) for x in d) / 2
    for e in range(2):
        assert v.grad[0, e].item() == pytest.approx(-sign * A_MAX * 2 * 0.5 * d[e] / (w * 2), rel=1e-5)


def test_training_rows_from_the_schedule():
    sig = torch.linspace(1, 0, 11)
    trajs = [Trajectory(Request(seed=s), torch.zeros(11, 2, 1), sig, torch.zeros(10), torch.zeros(10, dtype=torch.bool))
             for s in range(3)]
    rows = training_rows(trajs, 4)
    assert [i for i, _, _ in rows] == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(3):
        ts = [t for j, t, _ in rows if j == i]
        assert len(set(ts)) == 4 and all(any(abs(t - float(s)) < 1e-7 for s in sig[:-1]) for t in ts)
    again = training_rows(trajs, 4)
    assert all(a[1] == b[1] and torch.equal(a[2], b[2]) for a, b in zip(rows, again))  # seeded: a resume redraws them
    with pytest.raises(ValueError, match="timesteps_per_sample=11 exceeds the rollout's 10 steps"):
        training_rows(trajs, 11)
    with pytest.raises(ConfigError, match="algorithm.diffusion_nft.timesteps_per_sample: 11 is outside"):
        load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_nft",
                                               "algorithm.diffusion_nft.timesteps_per_sample=11"])


def test_loss_in_forward_backward_matches_plain_autograd(single_rank):
    arch = tiny_config()
    model = lora_model(arch, single_rank.tp_group)
    g = torch.Generator().manual_seed(4)
    trajs = [Trajectory(Request(prompt=f"p{i % 2}", seed=i, img_fhw=(1, 4, 4)),
                        torch.randn(5, 16, arch.in_channels, generator=g, dtype=torch.float64), torch.linspace(1, 0, 5),
                        torch.zeros(4), torch.zeros(4, dtype=torch.bool)) for i in range(3)]
    text = {f"p{k}": (torch.randn(4 + k, arch.joint_attention_dim, generator=g, dtype=torch.float64), None)
            for k in range(2)}
    adv = torch.tensor([1.2, -0.4, -6.0])
    mbs = nft_microbatches(trajs, adv, text, timesteps=2, size=4)  # 6 rows: micro-batches of 4 and 2
    for mb in mbs:  # an old policy a little off the current one
        mb.old_velocity = (model(mb.x_t.double(), mb.txt.double(), mb.t, mb.img_fhw, mb.txt_mask).float().detach()
                           + 0.05 * torch.randn(mb.x_t.shape, generator=g))
    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_nft", "algorithm.diffusion_nft.ref_weight=0.3",
                                                 f"algorithm.adv_clip_max={A_MAX}"])
    model.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=NFT.forward_step(cfg, disable_adapters), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=4)
    megatron = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    losses = []
    for mb in mbs:
        v = model(mb.x_t.double(), mb.txt.double(), mb.t, mb.img_fhw, mb.txt_mask).float()
        with torch.no_grad(), disable_adapters(model):
            v_ref = model(mb.x_t.double(), mb.txt.double(), mb.t, mb.img_fhw, mb.txt_mask).float()
        t = mb.t.float().view(-1, 1, 1)
        r = (0.5 + 0.5 * (mb.advantage / A_MAX).clamp(-1, 1)).view(-1)
        d_pos = mb.x_t.float() - t * (BETA * v + (1 - BETA) * mb.old_velocity) - mb.x0
        d_neg = mb.x_t.float() - t * ((1 + BETA) * mb.old_velocity - BETA * v) - mb.x0
        w_pos = d_pos.abs().mean((1, 2)).detach().clamp_min(1e-5)
        w_neg = d_neg.abs().mean((1, 2)).detach().clamp_min(1e-5)
        policy = A_MAX * (r * (d_pos ** 2).mean((1, 2)) / w_pos + (1 - r) * (d_neg ** 2).mean((1, 2)) / w_neg).mean()
        losses.append(policy / BETA + 0.3 * ((v - v_ref) ** 2).mean((1, 2)).mean())
    (sum(losses) / len(mbs)).backward()
    errs = {n: rel_err(megatron[n], p.grad) for n, p in model.named_parameters() if p.requires_grad}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-6, (worst, errs[worst])
    assert sum(p.grad.norm() for p in model.parameters() if p.requires_grad) > 0
    for m, loss in zip(metrics, losses):
        assert m["loss"].item() == pytest.approx(loss.item(), rel=1e-5)
        assert m["ref_loss"].item() > 0


def test_rollouts_are_ode_with_final_samples_only():
    from types import SimpleNamespace

    from megatron_omni.data.tasks import build_task

    cfg = load_config("digits_flow_grpo", None, ["algorithm.name=diffusion_nft"])  # the recipe's SDE window of 4
    run = SimpleNamespace(cfg=cfg, task=build_task("digits"), family=cfg.model.family_impl)
    reqs = NFT.requests(run, 0)
    assert len(reqs) == 64 and all(r.sampler == "ode" and r.window_size is None for r in reqs)
    spec = NFT.record_spec(cfg)
    assert not spec.log_probs and not spec.step_latents
