"""Flow-GRPO as megatron-core's ``forward_step_func`` + ``loss_func`` (so the loss runs under TP / PP).

    forward_step = flow_grpo_forward_step(FlowGRPOLossConfig(clip_range=1e-5), reference=disable_adapters)
    with cuda_factories_on_cpu():  # on a CPU-only machine
        metrics = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                              model=model, num_microbatches=len(micro_batches), ...)

Each micro-batch is a ``FlowGRPOMicroBatch`` of B (sample, trained step) pairs.  ``forward_step`` runs the
model on the cond rows and, with a negative prompt, the uncond rows in a forward of their own under no_grad (one
padded forward on a pipeline stage: ``model_output``) and, when the KL term is on, the reference policy under
``torch.no_grad``; ``loss_func`` (last pipeline stage) combines true CFG in float32
with the uncond branch detached, forms the step mean μ_θ and log π_θ(x_t') with the rollout's own math in the
sampler kind and log-prob form the micro-batch carries (``megatron_omni.rollout.samplers``: the trainer scores
a step exactly as it was sampled), and returns
``(L, metrics)`` from ``flow_grpo.flow_grpo_loss``.

Reusing the rollout's uncond output (``mb.uncond_velocity``): the uncond branch is detached, so its only
role is the value v_u(x_t, t, negative prompt; θ).  While θ is still the rollout's (the first optimizer step
after a weight sync, or a log-prob recomputation before any update) the rollout already computed that value
from the same inputs; the forward then carries the B cond rows only — half the rows, and no backward through
an uncond half — and the loss, and every gradient, are those of the batched path.  The KL reference still
runs its own uncond rows: its v_u is the reference policy's, not the rollout's.

Loss normalisation (megatron-core 0.19.2, ``schedules.forward_step_calc_loss``): for a 2-tuple
``(loss, metrics)`` megatron does ``loss *= cp_size; loss /= num_microbatches`` IN PLACE on the returned
tensor before ``backward`` (a 3-tuple ``(loss, num_tokens, metrics)`` is divided by ``num_tokens`` and by
``num_microbatches`` instead, or left for ``finalize_model_grads`` to divide by the global token count when
``calculate_per_token_loss``).  ``loss_func`` returns the mean over its micro-batch, so the accumulated
gradient is the mean over micro-batches of the per-micro-batch means: the mean over all B·M pairs when
micro-batches are equally sized (the trainer's layout).  The metrics dict is appended unscaled, one per
micro-batch, to the list the schedule returns.  The ×cp_size undoes DDP's averaging over the CP ranks,
i.e. it expects each CP rank's loss to be its share of the total.  Under CP our model gathers the velocity
over the CP group at its output with a backward that keeps only this rank's image chunk of the gradient
(``megatron_omni.parallel.usp.gather_sequence``): every CP rank computes the whole-latent log-prob and the
whole loss here, unchanged, and back-propagates exactly its chunk's share, so the ×cp_size and DDP's mean
over data × context ranks give the true gradient (averaged over DP only).

Under PP, ``forward_step`` runs on every stage with the same micro-batch (non-first stages take only the
conditioning from it; the hidden state arrives through ``set_input_tensor``) and ``loss_func`` runs on the
last stage; its metrics and ``collect_non_loss_data`` outputs exist there only.

The model needs what megatron's schedules look up on it: ``config``, ``model_type`` and
``set_input_tensor`` (directly, or on a ``.module`` it wraps).  Inline reference forwards (``reference``)
are for PP = 1; under PP > 1 the reference means are scored before training in a forward-only pass of the schedule
with the reference's weights in place (every stage runs the reference's own chunk, fed by the reference's previous
stage), and the micro-batches carry them (``ref_mean``, ``reference_pass``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, ContextManager, Iterator

import torch

from megatron_omni.algorithms.flow_grpo.loss import FlowGRPOLossConfig, flow_grpo_loss
from megatron_omni.rollout.samplers import cfg_combine, check_kind, log_prob, step_mean_std

# reference(model) -> context manager yielding the module that computes the reference policy's velocity,
# e.g. model_specs.common.lora.disable_adapters, or ``lambda m: contextlib.nullcontext(frozen_copy)``
ReferenceFn = Callable[[torch.nn.Module], ContextManager[torch.nn.Module]]

# the metrics key of a training micro-batch's detached log π_θ [B]: the first optimizer step's are the rollout
# weights' own, so the log-prob check reads them instead of a forward of its own (FlowGRPO.train)
LOG_PROB = "log_prob"


@dataclass
class FlowGRPOMicroBatch:
    """B (sample, trained step) pairs of one rollout batch.  Legend: I image tokens, C packed latent
    channels, T text tokens, E text width, U negative-prompt tokens.

    t is σ at the step and also the model's timestep input; t' < t is where the step lands.
    """

    x_t: torch.Tensor  # [B, I, C] image tokens at t (the model input)
    txt: torch.Tensor  # [B, T, E] prompt embeddings
    txt_mask: torch.Tensor | None  # [B, T] bool, True = real token; None = all real
    img_fhw: tuple[int, int, int]  # token grid (frames, height, width)
    x_next: torch.Tensor  # [B, I, C] the rollout's x_t'
    t: torch.Tensor  # [B]
    t_next: torch.Tensor  # [B]
    old_log_prob: torch.Tensor  # [B] log π_old(x_t' | x_t) from the rollout (or the trainer's recomputation)
    advantage: torch.Tensor  # [B]
    noise_level: float | torch.Tensor  # a (scalar or [B])
    sigma_1: float  # the schedule's sigmas[1]: replaces t in σ_t's 1 − t where t = 1 (SDE)
    # the sampler kind and log-prob form that drew x_next (samplers.KINDS / LOG_PROB_FORMS): the trainer scores
    # each step with exactly the formula that sampled it, in the loss, the KL term and the consistency check
    sampler: str = "sde"
    log_prob_form: str = "gaussian"
    uncond_txt: torch.Tensor | None = None  # [B, U, E] negative-prompt embeddings: turns true CFG on
    uncond_mask: torch.Tensor | None = None  # [B, U]
    guidance_scale: float = 1.0  # true-CFG scale w
    cfg_rescale: str | None = "token"  # Qwen-Image true CFG: rescale to ‖v_cond‖ per token (samplers.cfg_combine)
    # [B, I, C] float32: the rollout's uncond output for these pairs, valid only while the weights are the
    # rollout's; set, the forward runs cond rows only and CFG combines with it (see the module docstring)
    uncond_velocity: torch.Tensor | None = None
    # [B, S_c, C]: fixed image tokens after x_t in every forward (an edit's source image, the rollout request's
    # context_latents), whole frames of img_fhw's grid; the velocity is the output's first I tokens
    context: torch.Tensor | None = None
    # {denoiser keyword: [B, ...]} the prompts' text extras (model_specs.family: SD3's pooled text), and the
    # negative prompts' with true CFG; None: the family has none
    txt_extras: dict[str, torch.Tensor] | None = None
    uncond_extras: dict[str, torch.Tensor] | None = None
    # the loss's pi_old is this forward's own log-prob, detached (the ratio is exactly 1), instead of old_log_prob:
    # the trainer's recomputation while the weights are still the rollout's, for a rollout whose own log-probs are
    # not the trainer's (an FP8 rollout: FlowGRPO.trainer_old_policy); old_log_prob stays the rollout's, for the check
    old_from_forward: bool = False
    # [B, I, C] float32 μ_ref of the KL's reference policy, scored before training by a forward-only pass of its own
    # with the reference's weights in place (FlowGRPO.with_reference_means: under PP, where a stage cannot run the
    # reference inline); None: the forward step runs the reference inline (``reference``), or there is no KL term
    ref_mean: torch.Tensor | None = None

    def __post_init__(self):
        check_kind(self.sampler)
        if self.sampler == "ode":
            raise ValueError("a FlowGRPO micro-batch of sampler 'ode' has no log-prob to train on; expected a "
                             "stochastic kind ('sde', 'cps', 'dance')")

    @property
    def has_cfg(self) -> bool:
        return self.uncond_txt is not None or self.uncond_velocity is not None

    @property
    def uncond_rows(self) -> bool:
        """Whether the policy forward carries uncond rows (true CFG without a reused uncond output)."""
        return self.uncond_txt is not None and self.uncond_velocity is None


def _pad_text(txt_BTE: torch.Tensor, mask_BT: torch.Tensor | None, length: int):
    """Zero-pad text to ``length`` tokens with a mask that excludes the padding."""
    b, n = txt_BTE.shape[:2]
    mask_BT = torch.ones(b, n, dtype=torch.bool, device=txt_BTE.device) if mask_BT is None else mask_BT
    pad = length - n
    return (torch.nn.functional.pad(txt_BTE, (0, 0, 0, pad)),
            torch.nn.functional.pad(mask_BT, (0, pad), value=False))


def model_inputs(mb: FlowGRPOMicroBatch, dtype: torch.dtype | None = None, uncond_rows: bool | None = None) -> tuple:
    """(img, txt, sigma, img_fhw, mask) for one forward; with uncond rows (default ``mb.uncond_rows``) they
    follow the cond rows ([2B, ...]), text padded to the longer of the two (padding is masked out of
    attention); without, the cond rows alone, unpadded.

    ``dtype``: the model's parameter dtype; image tokens and text are cast to it as the rollout engine
    casts them (the float32 latents of a bf16 rollout), so the model sees the very values it sampled with.
    The loss keeps ``mb.x_t`` in float32."""
    if uncond_rows is None:
        uncond_rows = mb.uncond_rows
    if uncond_rows and mb.uncond_txt is None:
        raise ValueError("model_inputs: uncond rows asked for a micro-batch without uncond_txt")
    if not uncond_rows:
        img, txt, sigma, mask = mb.x_t, mb.txt, mb.t, mb.txt_mask
    elif mb.txt_mask is None and mb.uncond_mask is None and mb.txt.shape[1] == mb.uncond_txt.shape[1]:
        img, txt, sigma, mask = (torch.cat([mb.x_t, mb.x_t]), torch.cat([mb.txt, mb.uncond_txt]),
                                 torch.cat([mb.t, mb.t]), None)  # nothing padded: no mask, as in the rollout
    else:
        length = max(mb.txt.shape[1], mb.uncond_txt.shape[1])
        txt_c, mask_c = _pad_text(mb.txt, mb.txt_mask, length)
        txt_u, mask_u = _pad_text(mb.uncond_txt, mb.uncond_mask, length)
        img, txt, sigma, mask = (torch.cat([mb.x_t, mb.x_t]), torch.cat([txt_c, txt_u]), torch.cat([mb.t, mb.t]),
                                 torch.cat([mask_c, mask_u]))
    img, fhw = _with_context(img, mb)
    if dtype is not None:
        img, txt = img.to(dtype), txt.to(dtype)
    return img, txt, sigma, fhw, mask


def model_extras(mb: FlowGRPOMicroBatch, dtype: torch.dtype | None = None,
                 uncond_rows: bool | None = None) -> dict[str, torch.Tensor]:
    """The text extras (keyword arguments) of the forward ``model_inputs`` builds: the cond rows', then with
    uncond rows the negative prompts' ([2B, ...]); cast to ``dtype`` as the rollout engine casts them."""
    if uncond_rows is None:
        uncond_rows = mb.uncond_rows
    extras = dict(mb.txt_extras or {})
    if uncond_rows:
        uncond = mb.uncond_extras or {}
        extras = {k: torch.cat([v, uncond[k]]) for k, v in extras.items()}
    return {k: v.to(dtype) for k, v in extras.items()} if dtype is not None else extras


def _with_context(img: torch.Tensor, mb: FlowGRPOMicroBatch) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(the forward's image tokens, its grid): with ``mb.context``, [x; context] per row at the stacked grid."""
    if mb.context is None:
        return img, mb.img_fhw
    from megatron_omni.rollout.engine import context_fhw

    rows = img.shape[0] // mb.context.shape[0]  # 2 with uncond rows
    ctx = torch.cat([mb.context] * rows) if rows > 1 else mb.context
    return torch.cat([img, ctx.to(img.dtype)], dim=1), context_fhw(mb.img_fhw, mb.context.shape[1])


def _check_context(model: torch.nn.Module, mb: FlowGRPOMicroBatch) -> None:
    bare = getattr(model, "module", model)
    if mb.context is not None and (not _whole(model) or getattr(bare, "cp_groups", None) is not None):
        raise ValueError("micro-batches with context tokens (an edit's source image) need pipeline- and context-"
                         "parallel size 1; expected parallel.pp = parallel.cp = 1 for edit training")


def model_output(model: torch.nn.Module, mb: FlowGRPOMicroBatch, dtype: torch.dtype | None = None,
                 uncond_rows: bool | None = None, joint: bool = False) -> torch.Tensor:
    """The model's output for ``mb``: its cond rows, then with uncond rows (default ``mb.uncond_rows``) the uncond
    rows.  On a whole model the uncond rows run as their own forward under no_grad, as the rollout engine runs a
    branch with its own text layout (unpadded, unmasked) and as the loss needs them (the uncond branch is
    detached: a backward through it is work thrown away).  A pipeline stage exchanges one hidden state per
    micro-batch, so there (and with ``joint``) both branches share one forward (``model_inputs``: text padded to
    the longer, masked)."""
    if uncond_rows is None:
        uncond_rows = mb.uncond_rows
    _check_context(model, mb)
    if not uncond_rows or joint or not _whole(model):
        return model(*model_inputs(mb, dtype, uncond_rows), **model_extras(mb, dtype, uncond_rows))
    if mb.uncond_txt is None:
        raise ValueError("model_output: uncond rows asked for a micro-batch without uncond_txt")
    cond = model(*model_inputs(mb, dtype, uncond_rows=False), **model_extras(mb, dtype, uncond_rows=False))
    (img, fhw), txt = _with_context(mb.x_t, mb), mb.uncond_txt
    if dtype is not None:
        img, txt = img.to(dtype), txt.to(dtype)
    with torch.no_grad():
        uncond_extras = {k: v if dtype is None else v.to(dtype) for k, v in (mb.uncond_extras or {}).items()}
        uncond = model(img, txt, mb.t, fhw, mb.uncond_mask, **uncond_extras)
    return torch.cat([cond, uncond])


def guided_velocity(out_BIC: torch.Tensor, mb: FlowGRPOMicroBatch) -> torch.Tensor:
    """float32 velocity of the policy: the model output, or with CFG v = v_u + w·(v_c − v_u) with the
    uncond branch detached, rescaled as ``mb.cfg_rescale`` says.  v_u is the output's uncond half when it
    has 2B rows ([cond; uncond], what ``model_inputs`` built), else ``mb.uncond_velocity``.  With ``mb.context``
    the output's first I tokens (the context's own are dropped, as the rollout drops them)."""
    if mb.context is not None:
        out_BIC = out_BIC[:, :mb.x_t.shape[1]]
    if not mb.has_cfg:
        return out_BIC.float()
    if out_BIC.shape[0] == 2 * mb.x_t.shape[0]:
        v_c, v_u = out_BIC.chunk(2, dim=0)
    elif mb.uncond_velocity is not None:
        v_c, v_u = out_BIC, mb.uncond_velocity.float()
    else:
        raise ValueError(f"guided_velocity: {out_BIC.shape[0]} output rows for {mb.x_t.shape[0]} CFG pairs and no "
                         f"uncond_velocity; expected the [cond; uncond] rows of model_inputs")
    return cfg_combine(v_c, v_u.detach(), mb.guidance_scale, mb.cfg_rescale)


def step_mean(v_BIC: torch.Tensor, mb: FlowGRPOMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ [B, I, C], step std [B, 1, 1]) of the micro-batch's sampler kind with velocity ``v_BIC``."""
    return step_mean_std(mb.sampler, mb.x_t, v_BIC, mb.t, mb.t_next, mb.noise_level, mb.sigma_1)


def step_log_prob(v_BIC: torch.Tensor, mb: FlowGRPOMicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(μ [B, I, C], log π(x_t' | x_t) [B], step std [B, 1, 1]) of the step with ``v_BIC``, in the micro-batch's
    sampler kind and log-prob form (the rollout's)."""
    mean_BIC, std_B11 = step_mean(v_BIC, mb)
    return mean_BIC, log_prob(mb.x_next, mean_BIC, std_B11, mb.log_prob_form), std_B11


def loss_func(mb: FlowGRPOMicroBatch, config: FlowGRPOLossConfig, ref_out: torch.Tensor | None,
              output: torch.Tensor, non_loss_data: bool = False):
    """megatron ``loss_func``: (L, metrics); with ``non_loss_data`` (forward-only log-prob recomputation)
    a dict with the detached log π_θ [B] and μ_θ."""
    mean_BIC, log_prob_B, std_B11 = step_log_prob(guided_velocity(output, mb), mb)
    if non_loss_data:
        return {LOG_PROB: log_prob_B.detach(), "mean": mean_BIC.detach()}
    loss, metrics = flow_grpo_loss(log_prob_B, mb.old_log_prob, mb.advantage, config, mean_BX=mean_BIC,
                                   ref_mean_BX=reference_mean(mb, config, ref_out), std_B=std_B11,
                                   dt_B=mb.t_next - mb.t)
    return loss, {**metrics, LOG_PROB: log_prob_B.detach()}


def reference_mean(mb: FlowGRPOMicroBatch, config, ref_out: torch.Tensor | None) -> torch.Tensor | None:
    """μ_ref [B, I, C] of the KL term: the inline reference forward's (``ref_out``), else the micro-batch's
    precomputed ``ref_mean``; None without either (ValueError when ``config.kl_beta > 0`` needs one)."""
    if ref_out is not None:
        return step_mean(guided_velocity(ref_out, mb), mb)[0]
    if mb.ref_mean is None and config.kl_beta > 0:
        raise ValueError(f"kl_beta={config.kl_beta} needs the reference policy's step means: an inline reference "
                         f"(flow_grpo_forward_step(reference=...)) or micro-batches from FlowGRPO.with_reference_means")
    return mb.ref_mean


def _with_log_prob(loss: Callable, mb: FlowGRPOMicroBatch, config, ref_out, output: torch.Tensor,
                   non_loss_data: bool = False):
    """``loss``'s result with ``LOG_PROB`` among its metrics (scored here, detached, where ``loss`` omits it).
    With ``mb.old_from_forward`` the loss sees that detached log-prob as ``old_log_prob`` (the same ops on the same
    output: bitwise the loss's own log π_θ, so the ratio is exactly 1)."""
    if mb.old_from_forward and not non_loss_data:
        with torch.no_grad():
            log_prob_B = step_log_prob(guided_velocity(output.detach(), mb), mb)[1]
        result = loss(replace(mb, old_log_prob=log_prob_B, old_from_forward=False), config, ref_out, output)
        return (*result[:-1], {**result[-1], LOG_PROB: log_prob_B})
    result = loss(mb, config, ref_out, output, non_loss_data)
    if non_loss_data or LOG_PROB in result[-1]:
        return result
    with torch.no_grad():
        log_prob_B = step_log_prob(guided_velocity(output.detach(), mb), mb)[1]
    return (*result[:-1], {**result[-1], LOG_PROB: log_prob_B})


def flow_grpo_forward_step(config: FlowGRPOLossConfig, reference: ReferenceFn | None = None, *,
                           joint_uncond: bool = False, loss: Callable = loss_func, reference_pass: bool = False):
    """``forward_step_func(data_iterator, model)`` for megatron's ``forward_backward_func``; the iterator
    yields ``FlowGRPOMicroBatch``es.  When ``config.kl_beta > 0`` either ``reference`` (an inline forward of the
    reference on a whole model) or ``reference_pass``: the micro-batches carry ``ref_mean`` from a forward-only
    pass of their own (FlowGRPO.with_reference_means; the form that runs under PP).  ``joint_uncond``:
    cond and uncond rows in one padded forward on a whole model too, as a pipeline stage runs them (see
    ``model_output``).  ``loss``: the megatron ``loss_func`` with ``loss_func``'s signature (another algorithm of
    the family swaps in its own loss on the same forward; ``config`` is handed to it); its metrics get
    ``LOG_PROB``, the micro-batch's detached log π_θ, where it does not return them itself."""
    if config.kl_beta > 0 and reference is None and not reference_pass:
        raise ValueError(f"kl_beta={config.kl_beta} needs a reference policy: pass reference= (e.g. "
                         f"model_specs.common.lora.disable_adapters, or lambda m: contextlib.nullcontext(ref_model)), "
                         f"or reference_pass=True with micro-batches from FlowGRPO.with_reference_means")

    def forward_step(data_iterator: Iterator[FlowGRPOMicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        dtype = model.config.params_dtype
        output = model_output(model, mb, dtype, joint=joint_uncond)
        ref_out = None
        if config.kl_beta > 0 and reference is not None:
            if not _whole(model):
                raise ValueError("kl_beta > 0 with an inline reference forward needs pipeline-parallel size 1 (a "
                                 "pipeline stage would feed the reference the policy's hidden state); under PP "
                                 "pass reference_pass=True and score the reference means in a forward-only pass "
                                 "(FlowGRPO.with_reference_means)")
            if mb.has_cfg and mb.uncond_txt is None:
                raise ValueError("a KL reference with a reused uncond_velocity needs the micro-batch's uncond_txt, to "
                                 "run the reference's own uncond branch")
            with torch.no_grad(), reference(model) as ref_model:  # its own uncond rows: a reused v_u is the policy's
                ref_out = model_output(ref_model, mb, dtype, uncond_rows=mb.has_cfg, joint=joint_uncond)
        return output, partial(_with_log_prob, loss, mb, config, ref_out)

    return forward_step


def _whole(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds the whole network (not one pipeline stage of it)."""
    bare = getattr(model, "module", model)
    return bool(getattr(bare, "pre_process", True) and getattr(bare, "post_process", True))


__all__ = ["LOG_PROB", "FlowGRPOMicroBatch", "ReferenceFn", "flow_grpo_forward_step", "guided_velocity", "loss_func",
           "model_extras", "model_inputs", "model_output", "reference_mean", "step_log_prob", "step_mean"]
