"""GRPO-Guard's and Flow-DPPO's losses inside megatron-core's forward_backward_func (PP=1, several micro-batches;
LoRA with the KL to the adapters-off reference) give the gradients of plain autograd over the same micro-batches,
the losses written out by hand here.  The old policy's means are the current ones moved by c·z along each pair's
own noise z, so log ρ ≈ c per pair and the clip (both sides) and the KL mask (kept and masked) are exercised."""
import math

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_omni.algorithms.flow_grpo.step import guided_velocity, model_output, step_mean
from megatron_omni.algorithms.old_policy import OldMeanMicroBatch
from megatron_omni.algorithms.registry import get_algorithm
from megatron_omni.parallel import cuda_factories_on_cpu
from megatron_omni.rollout.samplers import gaussian_log_prob
from model_specs.common.lora import disable_adapters
from tests.algorithms.models import lora_model
from tests.qwen_image_reference import diffusers_reference, megatron_from_reference, rel_err, tiny_config

pytestmark = pytest.mark.numerics
FHW = (1, 4, 4)
NOISE, SIGMA_1 = 0.7, 0.95
EPS, TAU = 1e-4, 1e-5
SHIFTS = {"grpo_guard": [3e-4, -3e-4, 2e-5, -5e-5], "flow_dppo": [3e-3, -3e-3, 3e-3, -1e-4]}
TOL = 1e-6


def _micro_batches(model, arch, shifts, dtype):
    g = torch.Generator().manual_seed(5)
    n_img, mbs = FHW[0] * FHW[1] * FHW[2], []
    for i in range(2):
        t = torch.tensor([1.0, 0.55]) if i == 0 else torch.rand(2, generator=g) * 0.6 + 0.3
        mb = OldMeanMicroBatch(
            x_t=torch.randn(2, n_img, arch.in_channels, generator=g).to(dtype),
            txt=torch.randn(2, 6, arch.joint_attention_dim, generator=g).to(dtype), txt_mask=None, img_fhw=FHW,
            x_next=torch.zeros(2, n_img, arch.in_channels, dtype=dtype), t=t, t_next=t - 0.2,
            old_log_prob=torch.zeros(2), advantage=torch.tensor([1.3, -0.6]), noise_level=NOISE, sigma_1=SIGMA_1)
        with torch.no_grad():
            mean, std = step_mean(guided_velocity(model_output(model, mb), mb), mb)
        z = torch.randn(mean.shape, generator=g)
        c = torch.tensor(shifts[2 * i:2 * i + 2]).view(-1, 1, 1)
        mb.old_mean = mean - c * z  # μ_θ − μ_old = c·z
        mb.x_next = (mb.old_mean + std * z).to(dtype)
        mb.old_log_prob = gaussian_log_prob(mb.x_next, mb.old_mean, std)
        mbs.append(mb)
    return mbs


def _plain(model, mb, name, kl_beta):
    """docs/algorithms.md by hand, float32 after the model: the SDE step, then the algorithm's loss per pair."""
    x, x_next = mb.x_t.float(), mb.x_next.float()
    t, dt = mb.t.view(-1, 1, 1), (mb.t_next - mb.t).view(-1, 1, 1)
    sigma = NOISE * torch.sqrt(t / (1 - torch.where(t == 1, torch.tensor(SIGMA_1), t)))

    def mean_of(m):
        v = m(mb.x_t, mb.txt, mb.t, FHW, None).float()
        return x * (1 + sigma ** 2 * dt / (2 * t)) + v * (1 + sigma ** 2 * (1 - t) / (2 * t)) * dt

    mean, s = mean_of(model), (sigma * torch.sqrt(-dt)).view(-1)
    log_prob = (-(x_next - mean) ** 2 / (2 * s.view(-1, 1, 1) ** 2) - torch.log(s.view(-1, 1, 1))
                - 0.5 * math.log(2 * math.pi)).mean((1, 2))
    shift = ((mean - mb.old_mean) ** 2).mean((1, 2)) / (2 * s ** 2)
    a, log_ratio = mb.advantage, log_prob - mb.old_log_prob
    if name == "grpo_guard":
        rho = torch.exp((log_ratio + shift) * s)
        loss = (torch.maximum(-a * rho, -a * rho.clamp(1 - EPS, 1 + EPS)) / -dt.view(-1)).mean()
        flags = torch.stack([rho > 1 + EPS, rho < 1 - EPS])
    else:
        rho = torch.exp(log_ratio)
        masked = (shift.detach() >= TAU) & (((rho > 1) & (a > 0)) | ((rho < 1) & (a < 0)))
        loss = torch.where(masked, torch.zeros_like(rho), -a * rho).mean()
        flags = torch.stack([masked, ~masked])
    if kl_beta:
        with torch.no_grad(), disable_adapters(model):
            ref_mean = mean_of(model)
        loss = loss + kl_beta * (((mean - ref_mean) ** 2).mean((1, 2)) / (2 * sigma.view(-1) ** 2)).mean()
    return loss, flags


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _check(model, arch, name, dtype, cfg_overrides):
    from megatron_omni.config import load_config

    cfg = load_config("digits_flow_grpo", None, [f"algorithm.name={name}", f"algorithm.clip_range={EPS}",
                                                 f"algorithm.flow_dppo.kl_threshold={TAU}", *cfg_overrides])
    algo = get_algorithm(name)
    mbs = _micro_batches(model, arch, SHIFTS[name], dtype)
    reference = disable_adapters if cfg.algorithm.kl_beta > 0 else None
    model.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=algo.forward_step(cfg, reference), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=2, forward_only=False)
    megatron = _grads(model)
    model.zero_grad(set_to_none=True)
    losses, flags = zip(*(_plain(model, mb, name, cfg.algorithm.kl_beta) for mb in mbs))
    (sum(losses) / len(mbs)).backward()
    plain = _grads(model)
    assert sum(g.norm() for g in plain.values()) > 0  # some pairs inside the clip / mask carry a gradient
    errs = {n: rel_err(megatron[n], g) for n, g in plain.items()}
    worst = max(errs, key=errs.get)
    print(f"{name}: worst grad rel err {worst} {errs[worst]:.1e} over {len(errs)} tensors")
    assert errs[worst] <= TOL, worst
    flags = torch.cat(flags, dim=1)
    assert flags[0].any() and flags[1].any()  # guard: clipped above and below; dppo: masked and kept
    for m, loss in zip(metrics, losses):
        assert m["loss"].item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", ["grpo_guard", "flow_dppo"])
def test_full_model_float32_matches_plain_autograd(single_rank, name):
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    _check(model, arch, name, torch.float32, [])


@pytest.mark.parametrize("name", ["grpo_guard", "flow_dppo"])
def test_lora_with_kl_matches_plain_autograd(single_rank, name):
    arch = tiny_config()
    model = lora_model(arch, single_rank.tp_group)
    _check(model, arch, name, torch.float64, ["algorithm.kl_beta=0.3"])


def test_loss_without_old_means_is_refused(single_rank):
    from megatron_omni.algorithms.old_policy import old_mean_loss_func
    from megatron_omni.algorithms.grpo_guard.loss import grpo_guard_loss

    mb = OldMeanMicroBatch(x_t=torch.zeros(1, 16, 4), txt=torch.zeros(1, 2, 8), txt_mask=None, img_fhw=FHW,
                           x_next=torch.zeros(1, 16, 4), t=torch.tensor([0.5]), t_next=torch.tensor([0.3]),
                           old_log_prob=torch.zeros(1), advantage=torch.ones(1), noise_level=NOISE, sigma_1=SIGMA_1)
    with pytest.raises(ValueError, match="with_old_means"):
        old_mean_loss_func(grpo_guard_loss, mb, None, None, torch.zeros(1, 16, 4))
