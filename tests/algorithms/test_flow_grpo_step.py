"""The Flow-GRPO loss inside megatron-core's forward_backward_func (PP=1, several micro-batches, true CFG on
one, KL to the LoRA-disabled reference) gives the gradients of plain autograd over the same micro-batches.

The plain reference is written out independently, and runs CFG as two separate unpadded forwards with the
uncond branch under autograd (detached in the loss); the step runs the uncond rows under no_grad.  In float32
the two agree only to ~1e-5 in the gradients
(CFG scale 4 amplifies the ~3e-7 rounding of a differently batched forward; float32 and float64 gradients
differ by as much), so the CFG case runs the model in float64, where any real difference would show
far above 1e-6.  Without CFG the float32 gradients agree exactly."""
import math
from dataclasses import replace

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.algorithms.flow_grpo import FlowGRPOLossConfig
from megatron_omni.algorithms.flow_grpo.step import (
    FlowGRPOMicroBatch, flow_grpo_forward_step, guided_velocity, model_inputs, model_output, step_log_prob,
)
from megatron_omni.parallel import cuda_factories_on_cpu
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, disable_adapters
from tests.algorithms.models import lora_model
from tests.qwen_image_reference import diffusers_reference, megatron_from_reference, rel_err, tiny_config

FHW = (1, 4, 4)
NOISE, SIGMA_1, CFG_SCALE = 0.7, 0.95, 4.0
TOL = 1e-6
LOSS_ATOL = 1e-6  # float32 loss terms of size ~1 (|A|·ρ, β·KL) summed in another order: see its use


def _micro_batches(model, arch, count=3, b=2, cfg_index=1, dtype=torch.float32):
    """Random steps scored by the current policy; old log-probs offset so that ratios fall inside and
    outside the clip range (1e-4) on both sides.  Micro-batch ``cfg_index`` carries a negative prompt."""
    g = torch.Generator().manual_seed(11)
    n_img = FHW[0] * FHW[1] * FHW[2]
    mbs = []
    for i in range(count):
        t = torch.tensor([1.0, 0.55])[:b] if i == 0 else torch.rand(b, generator=g) * 0.6 + 0.3
        mask = torch.ones(b, 6, dtype=torch.bool)
        mask[1, 4:] = False
        mb = FlowGRPOMicroBatch(
            x_t=torch.randn(b, n_img, arch.in_channels, generator=g), txt=torch.randn(b, 6, arch.joint_attention_dim,
                                                                                      generator=g),
            txt_mask=mask, img_fhw=FHW, x_next=torch.zeros(b, n_img, arch.in_channels), t=t, t_next=t - 0.2,
            old_log_prob=torch.zeros(b), advantage=torch.tensor([1.3, -0.6]), noise_level=NOISE, sigma_1=SIGMA_1)
        if i == cfg_index:
            mb.uncond_txt, mb.guidance_scale = torch.randn(b, 3, arch.joint_attention_dim, generator=g), CFG_SCALE
        for name in ("x_t", "txt", "x_next", "uncond_txt"):
            if getattr(mb, name) is not None:
                setattr(mb, name, getattr(mb, name).to(dtype))
        with torch.no_grad():
            mean, _, std = step_log_prob(guided_velocity(model_output(model, mb), mb), mb)
            mb.x_next = (mean + std * torch.randn(mean.shape, generator=g)).to(dtype)
            _, log_prob, _ = step_log_prob(guided_velocity(model_output(model, mb), mb), mb)
        mb.old_log_prob = log_prob + torch.tensor([3e-4, -2e-5]) * (1 - 2 * (i % 2))
        mbs.append(mb)
    return mbs


def _plain_velocity(model, mb, cfg_on):
    """Written out independently: cond and uncond as separate, unpadded forwards; the rescaled true CFG."""
    v_c = model(mb.x_t, mb.txt, mb.t, FHW, mb.txt_mask).float()
    if not cfg_on:
        return v_c
    with torch.no_grad():
        v_u = model(mb.x_t, mb.uncond_txt, mb.t, FHW, None).float()
    v = v_u + mb.guidance_scale * (v_c - v_u)
    return v * (v_c.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))


def _plain_loss(model, mb, cfg: FlowGRPOLossConfig):
    """docs/algorithms.md's formulas, by hand, in float32 after the model (as the sampler math runs)."""
    x, x_next = mb.x_t.float(), mb.x_next.float()
    t, dt = mb.t.view(-1, 1, 1), (mb.t_next - mb.t).view(-1, 1, 1)
    sigma = NOISE * torch.sqrt(t / (1 - torch.where(t == 1, torch.tensor(SIGMA_1), t)))

    def mean_of(v):
        return x * (1 + sigma ** 2 * dt / (2 * t)) + v * (1 + sigma ** 2 * (1 - t) / (2 * t)) * dt

    mean = mean_of(_plain_velocity(model, mb, mb.uncond_txt is not None))
    std = sigma * torch.sqrt(-dt)
    log_prob = (-(x_next - mean) ** 2 / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean((1, 2))
    ratio = torch.exp(log_prob - mb.old_log_prob)
    a, eps = mb.advantage, cfg.clip_range
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps)).mean()
    if cfg.kl_beta:
        with torch.no_grad(), disable_adapters(model):
            ref_mean = mean_of(_plain_velocity(model, mb, mb.uncond_txt is not None))
        var = sigma.view(-1) ** 2 * (-dt.view(-1) if cfg.kl_form == "exact" else 1)
        loss = loss + cfg.kl_beta * (((mean - ref_mean) ** 2).mean((1, 2)) / (2 * var)).mean()
    return loss, ratio.detach()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _compare(model, mbs, cfg, reference=None):
    """(per-parameter grad rel err, megatron's per-micro-batch metrics, plain per-micro-batch losses, ratios)."""
    megatron_grads, metrics = _megatron_grads(model, mbs, cfg, reference)
    model.zero_grad(set_to_none=True)
    losses, ratios = zip(*(_plain_loss(model, mb, cfg) for mb in mbs))
    (sum(losses) / len(mbs)).backward()
    plain = _grads(model)
    return {n: rel_err(megatron_grads[n], plain[n]) for n in plain}, metrics, losses, torch.cat(ratios)


@pytest.mark.numerics
@pytest.mark.parametrize("kl_form", ["flow_grpo", "exact"])
def test_lora_with_cfg_and_kl_matches_plain_autograd(single_rank, kl_form):
    arch = tiny_config()
    model = lora_model(arch, single_rank.tp_group)
    mbs = _micro_batches(model, arch, dtype=torch.float64)
    cfg = FlowGRPOLossConfig(clip_range=1e-4, kl_beta=0.3, kl_form=kl_form)
    errs, metrics, losses, ratios = _compare(model, mbs, cfg, reference=disable_adapters)
    worst = max(errs, key=errs.get)
    print(f"LoRA + CFG + KL: worst grad rel err {worst} {errs[worst]:.1e} over {len(errs)} adapter tensors")
    assert errs[worst] <= TOL, worst
    assert ((ratios > 1 + 1e-4).any() and (ratios < 1 - 1e-4).any()
            and ((ratios - 1).abs() <= 1e-4).any())  # the clip is exercised both ways
    assert len(metrics) == len(mbs)
    for m, loss in zip(metrics, losses):  # metrics keep the unscaled per-micro-batch loss
        # the loss math runs in float32 after the float64 model, in another op order than the hand-written one
        # (and its reductions vectorise by CPU capability): ~1e-7 of the terms it sums, -A·ρ with |A| ~ 1 and
        # β·KL ~ 0.3.  Those terms nearly cancel (one micro-batch's loss is ~6e-3), so a relative bound alone is
        # fragile (measured on an AVX-512 Xeon: 6e-8 apart, 1.05e-5 relative): LOSS_ATOL at the terms' scale.
        # A wrong clip side, KL form (exact vs flow_grpo: 5x the KL) or CFG rule moves it by >= 1e-3.
        assert m["loss"].item() == pytest.approx(loss.item(), rel=1e-5, abs=LOSS_ATOL)
        assert m["kl"].item() > 0


@pytest.mark.numerics
def test_full_model_float32_matches_plain_autograd(single_rank):
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    mbs = _micro_batches(model, arch, count=2, cfg_index=None)
    errs, metrics, _, _ = _compare(model, mbs, FlowGRPOLossConfig(clip_range=1e-4))
    worst = max(errs, key=errs.get)
    print(f"full model, float32: worst grad rel err {worst} {errs[worst]:.1e} over {len(errs)} tensors")
    assert errs[worst] <= TOL, worst
    assert metrics[0]["kl"].item() == 0.0
    with cuda_factories_on_cpu():  # forward-only recomputation of log π (collect_non_loss_data)
        collected = get_forward_backward_func()(
            forward_step_func=flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-4)), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=2, forward_only=True, collect_non_loss_data=True)
    with torch.no_grad():
        for mb, out in zip(mbs, collected):
            assert torch.equal(out["log_prob"], step_log_prob(guided_velocity(model_output(model, mb), mb), mb)[1])


def test_kl_needs_a_reference():
    with pytest.raises(ValueError, match="kl_beta=0.1 needs a reference policy"):
        flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-4, kl_beta=0.1))


def test_bf16_model_takes_float32_rollout_latents(single_rank):
    """A bf16 policy trains on the float32 latents a bf16 rollout keeps: the step casts the model's inputs
    to its dtype as the engine does, and keeps x_t in float32 for the SDE mean."""
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group, dtype=torch.bfloat16)
    mbs = _micro_batches(model.float(), arch, count=2)  # float32 micro-batches, scored by the float32 copy
    model.bfloat16()
    with cuda_factories_on_cpu():
        collected = get_forward_backward_func()(
            forward_step_func=flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-4)), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=2, forward_only=True, collect_non_loss_data=True)
    with torch.no_grad():
        for mb, out in zip(mbs, collected):
            assert mb.x_t.dtype == torch.float32
            expected = step_log_prob(guided_velocity(model_output(model, mb, torch.bfloat16), mb), mb)[1]
            assert torch.equal(out["log_prob"], expected)


def _megatron_grads(model, mbs, cfg, reference=None):
    """(per-parameter grads, per-micro-batch metrics) of megatron's schedule over ``mbs``."""
    model.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        metrics = get_forward_backward_func()(
            forward_step_func=flow_grpo_forward_step(cfg, reference), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), seq_length=1, micro_batch_size=mbs[0].t.numel(), forward_only=False)
    return _grads(model), metrics


def _with_rollout_uncond(model, mbs):
    """The micro-batches carrying the uncond output of the weights they were scored with, as the rollout keeps
    it: the uncond rows' own forward (as the rollout computes them)."""
    out = []
    for mb in mbs:
        with torch.no_grad():
            v_u = model_output(model, mb)[mb.t.numel():].float() if mb.has_cfg else None
        out.append(replace(mb, uncond_velocity=v_u))
    return out


def _cfg_micro_batches(model, arch, dtype, b=4, count=2):
    """CFG micro-batches of ``b`` pairs (padded prompt text longer than the negative prompt's), x_t' drawn from
    the policy's step and old log-probs offset so that ratios fall inside and outside the clip range (1e-4)."""
    g = torch.Generator().manual_seed(5)
    n_img, e = FHW[0] * FHW[1] * FHW[2], arch.joint_attention_dim
    mbs = []
    for i in range(count):
        t = torch.rand(b, generator=g) * 0.6 + 0.3
        t[0] = 1.0
        mask = torch.ones(b, 6, dtype=torch.bool)
        mask[1, 4:] = False
        mb = FlowGRPOMicroBatch(
            x_t=torch.randn(b, n_img, arch.in_channels, generator=g).to(dtype),
            txt=torch.randn(b, 6, e, generator=g).to(dtype), txt_mask=mask, img_fhw=FHW,
            x_next=torch.zeros(b, n_img, arch.in_channels, dtype=dtype), t=t, t_next=t - 0.2,
            old_log_prob=torch.zeros(b), advantage=torch.randn(b, generator=g), noise_level=NOISE, sigma_1=SIGMA_1,
            uncond_txt=torch.randn(b, 3, e, generator=g).to(dtype), guidance_scale=CFG_SCALE)
        with torch.no_grad():
            mean, _, std = step_log_prob(guided_velocity(model_output(model, mb), mb), mb)
            mb.x_next = (mean + std * torch.randn(mean.shape, generator=g)).to(dtype)
            _, log_prob, _ = step_log_prob(guided_velocity(model_output(model, mb), mb), mb)
        mb.old_log_prob = log_prob + torch.tensor([3e-4, -2e-5, 5e-5, -3e-4])[:b] * (1 - 2 * (i % 2))
        mbs.append(mb)
    return mbs


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("lora_kl", [False, True], ids=["full", "lora_kl"])
def test_reused_uncond_matches_batched_cfg(single_rank, lora_kl, dtype):
    """First optimizer step after a rollout: cond rows only + the rollout's v_u give the loss and every
    gradient of the batched cond + uncond forward, and the same re-scored log π; with KL the reference still
    runs its own uncond rows.  float64: 1e-6 relative, far above its rounding: any difference of the math shows.
    float32: the reused path's forward has 4 rows, the batched one 8.  Where the CPU's float32 kernels give a row
    the same bits at 4 rows as at 8 (measured on an AMD EPYC and an AVX-512 Xeon) the two agree exactly; where they
    do not (another BLAS or CPU blocks the rows otherwise; measured earlier with 2-row forwards, whose conditioning
    linears took another kernel) a last-bit difference in v_u is amplified by CFG 4 to ~1e-5 in the gradients
    (emulated by rounding v_u by 1.2e-7 at random: worst grad 5.4e-6, loss 5e-7 relative, log π 1.2e-7 absolute,
    2e-4 relative on a log π near 0).  So float32: gradients 1e-4, the loss rel 1e-5 + abs 1e-6 and log π abs 1e-6
    (|log π| ~ 1, float32 rounding ~1e-7).  A v_u of another pair or step moves the gradients and log π by O(1)."""
    grad_tol, loss_rtol, loss_atol, lp_atol = (TOL, TOL, 0.0, 0.0) if dtype == torch.float64 else (1e-4, 1e-5, 1e-6,
                                                                                                  1e-6)
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group, dtype=dtype)
    reference = None
    if lora_kl:
        apply_lora(model, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(arch))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
        reference = disable_adapters
    mbs = _cfg_micro_batches(model, arch, dtype)
    cfg = FlowGRPOLossConfig(clip_range=1e-4, kl_beta=0.3 if lora_kl else 0.0)
    batched, batched_metrics = _megatron_grads(model, mbs, cfg, reference)
    reused_mbs = _with_rollout_uncond(model, mbs)
    assert all(not mb.uncond_rows and model_inputs(mb)[0].shape[0] == mb.t.numel() for mb in reused_mbs)
    reused, reused_metrics = _megatron_grads(model, reused_mbs, cfg, reference)
    errs = {n: rel_err(reused[n], batched[n]) for n in batched}
    worst = max(errs, key=errs.get)
    loss_err = max(abs(a["loss"].item() / b["loss"].item() - 1) for a, b in zip(reused_metrics, batched_metrics))
    print(f"reused uncond ({'LoRA + KL' if lora_kl else 'full'}, {dtype}): loss rel err {loss_err:.1e}, worst grad "
          f"rel err {worst} {errs[worst]:.1e} over {len(errs)} tensors")
    assert errs[worst] <= grad_tol, worst
    for a, b in zip(reused_metrics, batched_metrics):
        assert a["loss"].item() == pytest.approx(b["loss"].item(), rel=loss_rtol, abs=loss_atol)
    assert sum(int(batched[n].abs().max() > 0) for n in batched) > len(batched) // 2
    assert all((m["kl"].item() > 0) == lora_kl for m in reused_metrics)
    ratios = torch.stack([m["ratio_mean"] for m in batched_metrics])
    assert torch.all(ratios != 1)
    with torch.no_grad():  # the forward-only log-prob recomputation before any update
        for mb, rmb in zip(mbs, reused_mbs):
            lp = step_log_prob(guided_velocity(model_output(model, mb), mb), mb)[1]
            lp_reused = step_log_prob(guided_velocity(model_output(model, rmb), rmb), rmb)[1]
            assert torch.allclose(lp_reused, lp, rtol=TOL, atol=lp_atol)


def test_reused_uncond_needs_its_rows_or_the_velocity():
    mb = FlowGRPOMicroBatch(x_t=torch.zeros(2, 4, 3), txt=torch.zeros(2, 5, 7), txt_mask=None, img_fhw=FHW,
                            x_next=torch.zeros(2, 4, 3), t=torch.ones(2), t_next=torch.zeros(2),
                            old_log_prob=torch.zeros(2), advantage=torch.zeros(2), noise_level=NOISE, sigma_1=SIGMA_1,
                            uncond_txt=torch.zeros(2, 3, 7), guidance_scale=CFG_SCALE)
    assert mb.uncond_rows and model_inputs(mb)[0].shape[0] == 4
    with pytest.raises(ValueError, match="no uncond_velocity"):
        guided_velocity(torch.zeros(2, 4, 3), mb)
    reused = replace(mb, uncond_velocity=torch.ones(2, 4, 3))
    assert not reused.uncond_rows and model_inputs(reused)[1].shape == (2, 5, 7)  # cond text, not padded to U
    assert guided_velocity(torch.ones(2, 4, 3), reused).shape == (2, 4, 3)


@pytest.mark.numerics
def test_uncond_rows_of_another_length_run_apart_without_autograd(single_rank):
    """On a whole model, a CFG micro-batch whose negative prompt has another text length runs its uncond rows as
    their own unpadded, unmasked forward under no_grad (as the rollout engine runs them; the loss detaches that
    branch): the output of the padded, masked joint forward to float32 rounding, one graph for the cond rows."""
    arch = tiny_config()
    model = megatron_from_reference(diffusers_reference(arch), arch, single_rank.tp_group)
    mb = _cfg_micro_batches(model, arch, torch.float32, count=1)[0]
    assert mb.uncond_rows and mb.txt.shape[1] != mb.uncond_txt.shape[1]
    calls = []
    handle = model.register_forward_hook(lambda m, args, out: calls.append(
        (args[0].shape[0], args[1].shape[1], args[4] is None, torch.is_grad_enabled())))
    split = model_output(model, mb)
    joint = model_output(model, mb, joint=True)
    handle.remove()
    b, t, u = mb.t.numel(), mb.txt.shape[1], mb.uncond_txt.shape[1]
    assert calls[:2] == [(b, t, mb.txt_mask is None, True), (b, u, mb.uncond_mask is None, False)]
    assert calls[2] == (2 * b, max(t, u), False, True)  # joint: padded to the longer text, masked
    torch.testing.assert_close(split, joint, rtol=1e-5, atol=1e-5)
