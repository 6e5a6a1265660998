"""One sampling step x_t -> x_t' of a rectified flow, with the step's Gaussian (mean, std) and log-prob.

The formulas are docs/algorithms.md's, and all arithmetic is float32 whatever the model dtype (bf16
overflows the SDE mean).  Each kind has a ``*_mean_std`` function so that the trainer recomputes
log-probs of stored steps with exactly the rollout's math: ``log_prob(x_next, *step_mean_std(...))``.

Shape legend: B batch; X the latent dims of one sample (any number, e.g. [S_I, C]); N steps.
x_BX, v_BX, z_BX are [B, *X]; the time arguments t, t_next and the noise level are Python floats,
0-d tensors or [B] tensors; std_B1 broadcasts against x_BX ([B, 1, ..., 1]); log-probs are [B].
"""
from __future__ import annotations

import math
from typing import Callable

import torch

KINDS = ("ode", "sde", "cps", "dance")  # Euler, Flow-GRPO SDE, coefficients-preserving, DanceGRPO SDE
LOG_PROB_FORMS = ("gaussian", "simple")  # exact Gaussian; CPS references' -mean (x' - μ)²
CFG_RESCALES = ("token", "sample", None)
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _per_sample(value, x_BX: torch.Tensor) -> torch.Tensor:
    """A float, 0-d or [B] value as a float32 tensor that broadcasts against x_BX ([B, 1, ..., 1] or 0-d)."""
    if isinstance(value, (int, float)):  # a fill on the device: as_tensor would copy from the host and wait
        t = torch.full((), float(value), dtype=torch.float32, device=x_BX.device)
    else:
        t = torch.as_tensor(value, dtype=torch.float32, device=x_BX.device)
    if t.dim() == 0:
        return t
    if t.shape != x_BX.shape[:1]:
        raise ValueError(f"per-sample value of shape {tuple(t.shape)}; expected a scalar or [{x_BX.shape[0]}]")
    return t.view(-1, *([1] * (x_BX.dim() - 1)))


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"sampler kind {kind!r}; expected one of {KINDS}")


def ode_mean_std(x_BX, v_BX, t, t_next) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler: x_t' = x_t + Δ·v (deterministic, std 0).  Written ``x + v·Δ`` like the SDE mean so that
    the SDE at noise level 0 reproduces it bit for bit."""
    x_BX, v_BX = x_BX.float(), v_BX.float()
    dt = _per_sample(t_next, x_BX) - _per_sample(t, x_BX)
    return x_BX + v_BX * dt, torch.zeros_like(dt)


def sde_mean_std(x_BX, v_BX, t, t_next, noise_level, sigma_1) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO SDE: σ_t = a·sqrt(t / (1 − t)); μ = x·(1 + σ_t²·Δ/(2t)) + v·(1 + σ_t²·(1 − t)/(2t))·Δ;
    std = σ_t·sqrt(−Δ).

    t = 1 would divide by zero: there the denominator is 1 − σ_1, with σ_1 = ``sigma_1`` the schedule's
    second sigma (``sigmas[1]``, the t' of the first step), while the numerator keeps t = 1.  This is
    flow_grpo's ``sqrt(sigma / (1 - where(sigma == 1, sigmas[1], sigma)))``.  At a = 0, σ_t = 0 and every
    coefficient is exactly 1, so μ = x + v·Δ is the Euler step bit for bit.
    """
    x_BX, v_BX = x_BX.float(), v_BX.float()
    t_B1, tn_B1 = _per_sample(t, x_BX), _per_sample(t_next, x_BX)
    dt = tn_B1 - t_B1
    denom = 1 - torch.where(t_B1 == 1, _per_sample(sigma_1, x_BX), t_B1)
    std_t = _per_sample(noise_level, x_BX) * torch.sqrt(t_B1 / denom)
    var_t = std_t ** 2
    mean = x_BX * (1 + var_t * dt / (2 * t_B1)) + v_BX * (1 + var_t * (1 - t_B1) / (2 * t_B1)) * dt
    return mean, std_t * torch.sqrt(-dt)


def cps_mean_std(x_BX, v_BX, t, t_next, noise_level) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients-preserving sampling: σ = t'·sin(a·π/2); x̂0 = x − t·v; x̂1 = x + (1 − t)·v;
    μ = x̂0·(1 − t') + x̂1·sqrt(t'² − σ²); std = σ.  The last step (t' = 0) is deterministic (std 0).
    At a = 0 it is the Euler step up to rounding.  At a fixed a > 0 the injected noise does not vanish
    with the step size, so unlike the SDE it does not keep the ODE's marginals (on a Gaussian toy flow,
    a = 0.7 leaves samples ~18% too narrow at any step count); that is the published method."""
    x_BX, v_BX = x_BX.float(), v_BX.float()
    t_B1, tn_B1 = _per_sample(t, x_BX), _per_sample(t_next, x_BX)
    std = tn_B1 * torch.sin(_per_sample(noise_level, x_BX) * (math.pi / 2))
    x0_BX = x_BX - t_B1 * v_BX
    x1_BX = x_BX + (1 - t_B1) * v_BX
    # t'² − σ² = t'²·cos²(a·π/2) >= 0; the clamp only removes a rounding-negative at a = 1
    mean = x0_BX * (1 - tn_B1) + x1_BX * torch.sqrt((tn_B1 ** 2 - std ** 2).clamp_min(0))
    return mean, std


def dance_mean_std(x_BX, v_BX, t, t_next, noise_level) -> tuple[torch.Tensor, torch.Tensor]:
    """DanceGRPO SDE: μ_ode = x + Δ·v; x̂0 = x − t·v; s = −(x − (1 − t)·x̂0)/t²; μ = μ_ode − ½·η²·s·Δ;
    std = η·sqrt(−Δ), with η the noise level."""
    x_BX, v_BX = x_BX.float(), v_BX.float()
    t_B1 = _per_sample(t, x_BX)
    dt = _per_sample(t_next, x_BX) - t_B1
    eta = _per_sample(noise_level, x_BX)
    mean_ode = x_BX + v_BX * dt
    x0_BX = x_BX - t_B1 * v_BX
    score_BX = -(x_BX - (1 - t_B1) * x0_BX) / t_B1 ** 2
    return mean_ode - 0.5 * eta ** 2 * score_BX * dt, eta * torch.sqrt(-dt)


def step_mean_std(kind: str, x_BX, v_BX, t, t_next, noise_level=0.0,
                  sigma_1=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, std) of one step of ``kind``; ``sigma_1`` (the schedule's ``sigmas[1]``) is needed by the SDE."""
    check_kind(kind)
    if kind == "ode":
        return ode_mean_std(x_BX, v_BX, t, t_next)
    if kind == "sde":
        if sigma_1 is None:
            raise ValueError("the SDE step needs sigma_1 (the schedule's sigmas[1]) for its t = 1 case; got None")
        return sde_mean_std(x_BX, v_BX, t, t_next, noise_level, sigma_1)
    if kind == "cps":
        return cps_mean_std(x_BX, v_BX, t, t_next, noise_level)
    return dance_mean_std(x_BX, v_BX, t, t_next, noise_level)


def gaussian_log_prob(x_next_BX, mean_BX, std_B1) -> torch.Tensor:
    """log N(x' | μ, std²) per element, averaged (MEAN, not sum) over all latent elements -> [B]:
    mean[−(x' − μ)²/(2·std²) − log std − ½·log 2π].  std must be > 0."""
    diff = x_next_BX.float() - mean_BX.float()
    std = std_B1.float()
    lp_BX = -diff ** 2 / (2 * std ** 2) - torch.log(std) - _HALF_LOG_2PI
    return lp_BX.flatten(1).mean(dim=1)


def simple_log_prob(x_next_BX, mean_BX) -> torch.Tensor:
    """The CPS reference implementations' log-prob: −mean (x' − μ)² over latent elements -> [B]
    (no variance scaling, no constants)."""
    return -(x_next_BX.float() - mean_BX.float()).pow(2).flatten(1).mean(dim=1)


def log_prob(x_next_BX, mean_BX, std_B1, form: str = "gaussian") -> torch.Tensor:
    """[B] log-prob of a given x_t' under the step's (μ, std) in ``form`` (see LOG_PROB_FORMS)."""
    if form == "gaussian":
        return gaussian_log_prob(x_next_BX, mean_BX, std_B1)
    if form == "simple":
        return simple_log_prob(x_next_BX, mean_BX)
    raise ValueError(f"log-prob form {form!r}; expected one of {LOG_PROB_FORMS}")


def cfg_combine(v_cond_BX, v_uncond_BX, scale: float, rescale: str | None = "token") -> torch.Tensor:
    """Classifier-free guidance in float32: v = v_u + w·(v_c − v_u), then optionally rescaled to the norm
    of v_c (Qwen-Image "true CFG"): ``"token"`` norms over the last (channel) dim of each token, as
    diffusers' QwenImagePipeline does; ``"sample"`` norms over all elements of each sample; None keeps v."""
    v_c, v_u = v_cond_BX.float(), v_uncond_BX.float()
    v_BX = v_u + scale * (v_c - v_u)
    if rescale is None:
        return v_BX
    if rescale == "token":
        return v_BX * (v_c.norm(dim=-1, keepdim=True) / v_BX.norm(dim=-1, keepdim=True))
    if rescale == "sample":
        shape_B1 = (-1, *([1] * (v_BX.dim() - 1)))
        return v_BX * (v_c.flatten(1).norm(dim=1).view(shape_B1) / v_BX.flatten(1).norm(dim=1).view(shape_B1))
    raise ValueError(f"CFG rescale {rescale!r}; expected one of {CFG_RESCALES}")


PREFETCH_BYTES = 0  # a batch's SDE noise up to this size is drawn before its first step (drawn_noise); 0: not yet A/B'd


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting: a copy from pageable memory first waits for every queued
    kernel (the host then stalls and the GPU idles while it queues the next); from pinned memory it joins the queue."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def per_request_noise(generators: list[torch.Generator], shape_X: tuple[int, ...], active_B: torch.Tensor,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """z_BX: standard normal from each sample's own (CPU) generator where ``active_B``, zeros elsewhere.
    A generator advances only on its own sample's active steps, so batching never changes a sample."""
    z = torch.stack([torch.randn(shape_X, generator=g) if a else torch.zeros(shape_X)
                     for g, a in zip(generators, active_B)])
    return to_device(z, device)


def drawn_noise(generators: list[torch.Generator], shape_X: tuple[int, ...], trained_BN: torch.Tensor,
                device: torch.device | str = "cpu") -> Callable[[int, torch.Tensor], torch.Tensor]:
    """``rollout``'s noise_fn with every trained step's z_BX drawn now, in one copy to ``device``: the same
    numbers as per_request_noise step by step (each generator still draws its own active steps in order), but no
    host work between the denoising steps.  Over ``PREFETCH_BYTES`` (the default 0: not yet measured on a GPU; long
    videos) it draws step by step."""
    steps = [i for i in range(trained_BN.shape[1]) if bool(trained_BN[:, i].any())]
    if len(steps) * len(generators) * math.prod(shape_X) * 4 > PREFETCH_BYTES:
        return lambda i, active_B: per_request_noise(generators, shape_X, active_B, device)
    z_SBX = to_device(torch.stack([per_request_noise(generators, shape_X, trained_BN[:, i]) for i in steps]), device) \
        if steps else None
    at = {i: k for k, i in enumerate(steps)}
    return lambda i, active_B: z_SBX[at[i]]


def rollout(velocity_fn: Callable[[torch.Tensor, int], torch.Tensor], x_BX: torch.Tensor, sigmas_N1: torch.Tensor,
            kind: str, noise_level: float, trained_BN: torch.Tensor,
            noise_fn: Callable[[int, torch.Tensor], torch.Tensor],
            log_prob_form: str = "gaussian") -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate from x at sigmas[0] to sigmas[N]: steps where ``trained_BN`` is True use ``kind`` (and get a
    log-prob), the others Euler.  ``velocity_fn(x_BX, i)`` is the model at t = sigmas[i];
    ``noise_fn(i, active_B)`` gives z_BX.  Returns latents [B, N + 1, *X] and log-probs [B, N]
    (float32, 0 where not trained)."""
    check_kind(kind)
    x_BX = x_BX.float()
    lat, lps = [x_BX], []
    trained_dev = to_device(trained_BN, x_BX.device)  # once, not per step
    for i in range(sigmas_N1.numel() - 1):
        t, t_next = sigmas_N1[i], sigmas_N1[i + 1]
        v_BX = velocity_fn(x_BX, i).float()
        next_BX, _ = ode_mean_std(x_BX, v_BX, t, t_next)
        active_B = trained_BN[:, i].cpu()
        lp_B = torch.zeros(x_BX.shape[0], device=x_BX.device)
        if kind != "ode" and bool(active_B.any()):
            mean_BX, std = step_mean_std(kind, x_BX, v_BX, t, t_next, noise_level, sigmas_N1[1])
            sde_BX = mean_BX + std * noise_fn(i, active_B)
            on_B = trained_dev[:, i]
            lp_B = torch.where(on_B, log_prob(sde_BX, mean_BX, std, log_prob_form), lp_B)
            next_BX = torch.where(on_B.view(-1, *([1] * (x_BX.dim() - 1))), sde_BX, next_BX)
        x_BX = next_BX
        lat.append(x_BX)
        lps.append(lp_B)
    return torch.stack(lat, dim=1), torch.stack(lps, dim=1)
