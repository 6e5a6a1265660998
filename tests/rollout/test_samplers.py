"""Sampler steps (ODE, SDE, CPS, Dance-SDE): marginals on a Gaussian toy flow, the noise-0 reduction,
log-probs against an independent float64 computation, and true CFG by hand."""
import math

import pytest
import torch
from scipy.stats import norm

from megatron_omni.rollout import samplers
from megatron_omni.rollout.samplers import (
    cfg_combine, drawn_noise, log_prob, ode_mean_std, per_request_noise, rollout, sde_mean_std, step_mean_std,
)
from megatron_omni.rollout.schedule import sigmas

# Toy problem: x0 ~ N(M, S²) per dim, x_t = (1 - t)·x0 + t·ε, so x_t ~ N((1 - t)·M, (1 - t)²S² + t²) and
# the exact velocity E[ε - x0 | x_t = x] = (t - (1 - t)S²)/var_t · (x - (1 - t)M) - M.
M = torch.tensor([1.0, -2.0, 0.5, 3.0])
S = torch.tensor([0.5, 1.5, 0.3, 1.0])


def toy_velocity(x, t: float):
    var = (1 - t) ** 2 * S ** 2 + t ** 2
    return (t - (1 - t) * S ** 2) / var * (x - (1 - t) * M) - M


def _toy_samples(kind, noise_level, num_steps=100, batch=40000, window=None):
    sig = sigmas(num_steps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, generator=g)
    trained = torch.ones(batch, num_steps, dtype=torch.bool) if window is None else window.expand(batch, -1)
    lat, lp = rollout(lambda x, i: toy_velocity(x, sig[i].item()), x, sig, kind, noise_level, trained,
                      lambda i, on: torch.randn(batch, 4, generator=g))
    return lat[:, -1], lp


@pytest.mark.parametrize("kind, level, window", [
    ("ode", 0.0, None), ("sde", 0.7, None), ("dance", 0.7, None), ("sde", 1.2, (20, 40)),
])
def test_samplers_reach_the_data_marginals_on_a_gaussian_flow(kind, level, window):
    mask = None
    if window is not None:  # MixGRPO: SDE steps inside the window only, ODE elsewhere
        mask = torch.zeros(100, dtype=torch.bool)
        mask[window[0]:window[1]] = True
    x, lp = _toy_samples(kind, level, window=mask)
    assert (x.mean(0) - M).abs().max() < 0.03 * S.max()
    assert (x.std(0) / S - 1).abs().max() < 0.03  # measured: ODE 0.020 (Euler error), SDE 0.004
    if kind == "ode":
        assert torch.all(lp == 0)
    elif mask is not None:
        assert torch.all(lp[:, ~mask] == 0) and torch.all(lp[:, mask] != 0)


def test_sde_and_ode_agree_with_each_other_but_not_per_sample():
    x_ode, _ = _toy_samples("ode", 0.0)
    x_sde, _ = _toy_samples("sde", 0.7)
    assert ((x_sde.std(0) - x_ode.std(0)) / S).abs().max() < 0.04
    assert ((x_sde.mean(0) - x_ode.mean(0)) / S).abs().max() < 0.03
    assert (x_sde - x_ode).abs().mean() > 0.1  # the SDE explores: same initial noise, other samples


def _random_step(seed=0, shape=(3, 5, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("step", [0, 3, 9])  # t = 1 (σ_1 case), a middle step, the last step (t' = 0)
def test_sde_at_noise_zero_is_the_ode_step_exactly(step):
    x, v, _ = _random_step()
    sig = sigmas(10, shift=3.0)
    ode, _ = ode_mean_std(x, v, sig[step], sig[step + 1])
    mean, std = sde_mean_std(x, v, sig[step], sig[step + 1], 0.0, sig[1])
    z = torch.randn(x.shape)
    assert torch.equal(mean, ode) and torch.equal(mean + std * z, ode)
    dance_mean, dance_std = step_mean_std("dance", x, v, sig[step], sig[step + 1], 0.0)
    assert torch.equal(dance_mean + dance_std * z, ode)
    cps_mean, cps_std = step_mean_std("cps", x, v, sig[step], sig[step + 1], 0.0)  # DDIM: equal up to rounding
    assert torch.all(cps_std == 0)
    torch.testing.assert_close(cps_mean, ode, rtol=1e-6, atol=1e-6)
    x_bf16, v_bf16 = x.bfloat16(), v.bfloat16()  # model-dtype inputs: the step is still float32
    mean16, _ = sde_mean_std(x_bf16, v_bf16, sig[step], sig[step + 1], 0.0, sig[1])
    ode16, _ = ode_mean_std(x_bf16, v_bf16, sig[step], sig[step + 1])
    assert mean16.dtype == torch.float32 and torch.equal(mean16, ode16)


def _float64_mean_std(kind, x, v, t, tn, a, sigma_1):
    """docs/algorithms.md's formulas, written independently in float64."""
    x, v, t, tn, dt = x.double(), v.double(), float(t), float(tn), float(tn) - float(t)
    if kind == "sde":
        std_t = a * math.sqrt(t / (1 - (float(sigma_1) if t == 1 else t)))
        mean = x * (1 + std_t ** 2 * dt / (2 * t)) + v * (1 + std_t ** 2 * (1 - t) / (2 * t)) * dt
        return mean, std_t * math.sqrt(-dt)
    if kind == "cps":
        std = tn * math.sin(a * math.pi / 2)
        return (x - t * v) * (1 - tn) + (x + (1 - t) * v) * math.sqrt(max(tn ** 2 - std ** 2, 0.0)), std
    x0 = x - t * v
    score = -(x - (1 - t) * x0) / t ** 2
    return x + dt * v - 0.5 * a ** 2 * score * dt, a * math.sqrt(-dt)


# CPS's last step has std 0, so it has no Gaussian log-prob: that one combination is left out
LOG_PROB_CASES = [(kind, form, step) for kind, form in (("sde", "gaussian"), ("cps", "gaussian"), ("cps", "simple"),
                                                      ("dance", "gaussian"))
                  for step in (0, 4, 9) if not (kind, form, step) == ("cps", "gaussian", 9)]


@pytest.mark.numerics
@pytest.mark.parametrize("kind, form, step", LOG_PROB_CASES)
def test_log_prob_matches_an_independent_float64_gaussian(kind, form, step):
    x, v, z = _random_step(seed=step)
    sig, a = sigmas(10, shift=2.0), 0.8
    mean, std = step_mean_std(kind, x, v, sig[step], sig[step + 1], a, sig[1])
    x_next = mean + std * z
    ours = log_prob(x_next, mean, std, form)
    mean64, std64 = _float64_mean_std(kind, x, v, sig[step], sig[step + 1], a, sig[1])
    torch.testing.assert_close(mean, mean64.float(), rtol=1e-5, atol=1e-5)
    x64 = x_next.double()
    if form == "simple":
        expected = -((x64 - mean64) ** 2).flatten(1).mean(1)
    else:
        expected = torch.from_numpy(norm.logpdf(x64.numpy(), mean64.numpy(), std64)).flatten(1).mean(1)
    assert ours.shape == (3,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def test_step_functions_take_per_sample_times_and_name_bad_ones():
    x, v, _ = _random_step()
    sig = sigmas(10)
    t_B, tn_B = sig[[0, 3, 7]], sig[[1, 4, 8]]
    mean_B, std_B = sde_mean_std(x, v, t_B, tn_B, 0.7, sig[1])
    for b in range(3):
        mean_b, std_b = sde_mean_std(x[b:b + 1], v[b:b + 1], t_B[b], tn_B[b], 0.7, sig[1])
        assert torch.equal(mean_B[b:b + 1], mean_b) and torch.equal(std_B[b].flatten(), std_b.flatten())
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        sde_mean_std(x, v, sig[:2], sig[1:3], 0.7, sig[1])
    with pytest.raises(ValueError, match="'heun'"):
        step_mean_std("heun", x, v, 1.0, 0.9)
    with pytest.raises(ValueError, match="sigma_1"):
        step_mean_std("sde", x, v, 1.0, 0.9, 0.7)
    with pytest.raises(ValueError, match="'sum'"):
        log_prob(x, x, torch.ones(()), "sum")


def test_true_cfg_combine_and_rescale_by_hand():
    v_c = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])  # one sample, two tokens, two channels
    v_u = torch.tensor([[[1.0, 0.0], [0.0, 0.5]]])
    w = 2.0
    combined = torch.tensor([[[5.0, 8.0], [0.0, 1.5]]])  # v_u + w·(v_c − v_u)
    assert torch.equal(cfg_combine(v_c, v_u, w, rescale=None), combined)
    per_token = torch.tensor([[[5.0 * 5 / math.sqrt(89), 8.0 * 5 / math.sqrt(89)], [0.0, 1.0]]])
    torch.testing.assert_close(cfg_combine(v_c, v_u, w), per_token, rtol=1e-6, atol=0)  # diffusers' rule
    per_sample = combined * (math.sqrt(26.0) / math.sqrt(91.25))
    torch.testing.assert_close(cfg_combine(v_c, v_u, w, rescale="sample"), per_sample, rtol=1e-6, atol=0)
    assert cfg_combine(v_c.bfloat16(), v_u.bfloat16(), w).dtype == torch.float32
    with pytest.raises(ValueError, match="'global'"):
        cfg_combine(v_c, v_u, w, rescale="global")


def test_per_request_noise_follows_each_generator_alone():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    z = per_request_noise(gens, (2, 3), torch.tensor([True, False, True]))
    assert torch.equal(z[0], torch.randn(2, 3, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(z[1], torch.zeros(2, 3))
    assert torch.equal(z[2], torch.randn(2, 3, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(per_request_noise(gens[1:2], (2, 3), torch.tensor([True]))[0],
                       torch.randn(2, 3, generator=torch.Generator().manual_seed(2)))  # gen 2 did not advance


@pytest.mark.parametrize("prefetch_bytes", [1 << 30, 0])
def test_drawn_noise_is_the_step_by_step_noise(monkeypatch, prefetch_bytes):
    """A batch's noise drawn before its first step (or, over PREFETCH_BYTES, step by step) is per_request_noise's
    at every trained step: each generator draws its own active steps in order, whatever the other samples do."""
    monkeypatch.setattr(samplers, "PREFETCH_BYTES", prefetch_bytes)
    trained = torch.tensor([[False, True, True, False, False],
                            [False, False, True, True, False],
                            [False, False, False, False, False]])
    drawn = drawn_noise([torch.Generator().manual_seed(s) for s in (1, 2, 3)], (2, 3), trained)
    stepwise = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    for i in (1, 2, 3):  # the steps rollout asks noise for: those with a trained sample
        assert torch.equal(drawn(i, trained[:, i]), per_request_noise(stepwise, (2, 3), trained[:, i])), i
    assert torch.equal(drawn(3, trained[:, 3])[0], torch.zeros(2, 3))
    untrained = drawn_noise([torch.Generator().manual_seed(1)], (2, 3), torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(KeyError):  # no trained step: nothing drawn, nothing to ask for
        untrained(0, torch.tensor([False]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_per_request_noise_on_cuda_is_the_cpu_noise_and_a_rollout_reads_it_complete(monkeypatch):
    """The pinned, non-blocking copy gives the device the very CPU draws; a rollout whose forward is still running
    when the copy is queued (a long kernel ahead of it) samples exactly what the same rollout samples on the CPU."""
    active = torch.tensor([True, False, True])
    on_gpu = per_request_noise([torch.Generator().manual_seed(s) for s in (1, 2, 3)], (64, 16), active, "cuda")
    on_cpu = per_request_noise([torch.Generator().manual_seed(s) for s in (1, 2, 3)], (64, 16), active)
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)

    busy = torch.randn(4096, 4096, device="cuda")

    def velocity(x, i):
        for _ in range(20):  # keep the GPU busy past the noise copy
            torch.mm(busy, busy)
        return -x

    def run(device, drawn=False):
        gens = [torch.Generator().manual_seed(s) for s in (4, 5)]
        x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(9)).to(device)
        trained = torch.tensor([[True, True, False], [False, True, True]])
        noise_fn = drawn_noise(gens, (8, 4), trained, device) if drawn else \
            lambda i, on: per_request_noise(gens, (8, 4), on, device)
        return rollout(velocity if device == "cuda" else (lambda x, i: -x), x, sigmas(3, 1.0).to(device), "sde",
                       0.7, trained, noise_fn)

    lat_c, lp_c = run("cpu")
    monkeypatch.setattr(samplers, "PREFETCH_BYTES", 1 << 30)
    for drawn in (False, True):  # the noise copied step by step, or all of it before the first step
        lat_g, lp_g = run("cuda", drawn)
        torch.testing.assert_close(lat_g.cpu(), lat_c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lp_g.cpu(), lp_c, rtol=1e-5, atol=1e-5)
