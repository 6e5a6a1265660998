"""Rollout engines: the ``RolloutEngine`` protocol and ``EmbeddedEngine`` (in-process, pure torch).

Protocol in one line: ``generate(requests) -> trajectories``; ``load_weights((hf_name, tensor), ...)``
as vLLM's loaders take them; ``sleep()`` / ``wake()`` around training phases.

EmbeddedEngine batches compatible requests (same image grid, steps, shift, sampler, noise level,
guidance, padded text length, context shape...) into one forward.  Batching never changes a sample's random
numbers: each request owns a ``torch.Generator`` seeded with ``request.seed`` that draws, in this
order, its SDE-window start (when drawn), its initial noise (unless ``request.noise_seed`` gives the initial noise
a generator of its own) and the noise of its own trained steps.

Shape legend: N steps; S_I image tokens; C packed latent channels; T text tokens (L after padding);
E text-embedding width; B requests in a batch (2B rows in the forward with CFG); S_c context tokens (an edit's
source image: whole frames after the sampled ones, see ``Request.context_latents``).
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import torch

from checkpoints_convert.mapping import Rule, hf_shapes, hf_views, to_mcore, tp_shard
from megatron_omni.data.text_layout import pad_rows, padded_length, real_tokens
from megatron_omni.rollout.config import EngineConfig
from megatron_omni.rollout.graphs import ReplayedForward
from megatron_omni.rollout.samplers import (
    CFG_RESCALES, KINDS, LOG_PROB_FORMS, cfg_combine, drawn_noise, rollout, to_device,
)
from megatron_omni.rollout.schedule import check_window, sde_window, sigmas
from model_specs.common.fp8 import check_fp8_device
from model_specs.common.rollout_linear import (
    drop_rollout_weights, enable_fp8, merge_adapters, refresh_rollout_weights,
)
from model_specs.common.fusion import fuse_inference, refresh_fused
from model_specs.common.norm_quantize import enable_adaln_fp8
from model_specs.common.lora import base_tensors
from model_specs.family import ModelFamily, TextExtras, family_of, split_encoding, stack_extras

# prompts -> (emb [N,T,E], mask [N,T]) or (emb, mask, extras {denoiser keyword: [N, ...]}): model_specs.family
EncodeFn = Callable[[list[str]], tuple]
# (a request's generator, img_fhw) -> its initial latents [S_I, C], as the model family's pipeline draws them
# (e.g. diffusers' prepare_latents, so a seed gives the pipeline's image); None: randn [S_I, C] from the generator
NoiseFn = Callable[[torch.Generator, tuple[int, int, int]], torch.Tensor]


@dataclass
class Request:
    """One sample to generate.  Give ``prompt`` (encoded by the engine's ``encode_prompts``, cached per
    string) or ``prompt_emb`` [T, E] with an optional bool ``prompt_mask`` [T] (True = real token) and, for a
    family whose text encoder gives more (model_specs.family: SD3's pooled text), ``prompt_extras``
    {denoiser keyword: one prompt's tensor, e.g. [P]}."""

    prompt: str = ""
    prompt_id: str | int | None = None
    prompt_emb: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    negative_prompt: str = ""  # the unconditional branch of CFG
    negative_prompt_emb: torch.Tensor | None = None
    negative_prompt_mask: torch.Tensor | None = None
    prompt_extras: TextExtras | None = None  # with prompt_emb: its further denoiser inputs, one prompt's rows
    negative_prompt_extras: TextExtras | None = None
    seed: int = 0
    # the seed of the initial noise's own generator (e.g. one per group: DanceGRPO's shared initial noise); None:
    # drawn by the request's generator (``seed``), which then draws only the window start and the steps' noise
    noise_seed: int | None = None
    img_fhw: tuple[int, int, int] = (1, 32, 32)  # packed token grid (frames, latent h / 2, latent w / 2)
    num_steps: int = 10
    shift: float = 1.0
    # an explicit schedule of num_steps + 1 sigmas (e.g. a pipeline's dynamic shift); None: sigmas(num_steps, shift)
    sigmas: tuple[float, ...] | None = None
    sampler: str = "sde"  # one of samplers.KINDS
    noise_level: float = 0.7
    window_size: int | None = None  # None: every step is trained (no step for "ode")
    window_range: tuple[int, int] | None = None  # inclusive start range; None: every start that fits
    window_start: int | None = None  # given start (e.g. shared by a group); None: drawn from the seed
    guidance_scale: float = 1.0  # > 1 enables true CFG with the negative prompt
    cfg_rescale: str | None = "token"  # samplers.cfg_combine: diffusers' Qwen-Image per-token rescale
    log_prob_form: str = "gaussian"  # "simple" (-mean (x' - μ)²) is offered for "cps"
    # keep the uncond model output of each trained step in Trajectory.uncond_velocity (true CFG only): the
    # trainer's first optimizer step after this rollout reuses it instead of running the uncond branch again
    keep_uncond_velocity: bool = False
    # [S_c, C] fixed image tokens appended after the sampled ones in every forward (an edit's VAE-encoded source
    # image): whole frames of img_fhw's grid, so the forward's grid is (f + S_c / (h * w), h, w) and its first
    # S_I output tokens are the velocity; None: the sampled tokens alone
    context_latents: torch.Tensor | None = None

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1


@dataclass
class Trajectory:
    """What a rollout keeps for the trainer; tensors live on the model's device (sigmas on the CPU)."""

    request: Request
    latents: torch.Tensor  # [N + 1, S_I, C] float32, latents[0] the initial noise
    sigmas: torch.Tensor  # [N + 1] float32, step i goes sigmas[i] -> sigmas[i + 1]
    log_probs: torch.Tensor  # [N] float32, 0 where the step is not trained
    trained: torch.Tensor  # [N] bool, True on SDE-window steps
    window_start: int | None = None
    # [K, S_I, C] float32: the uncond model output at each of the K trained steps (in step order), as the
    # rollout combined it; None unless request.keep_uncond_velocity with true CFG
    uncond_velocity: torch.Tensor | None = None

    @property
    def final_sample(self) -> torch.Tensor:
        return self.latents[-1]  # [S_I, C] at t = 0


class RolloutEngine(Protocol):
    def generate(self, requests: Sequence[Request]) -> list[Trajectory]: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def park(self) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


@dataclass
class _Prepared:
    request: Request
    key: tuple
    # per branch (cond, then uncond with CFG): text [L_j, E] right-padded with zeros, mask [L_j] (True = real
    # token) or None when nothing is padded, and the prompt's text extras (model_specs.family; {} for none)
    texts: list[tuple[torch.Tensor, torch.Tensor | None, TextExtras]]
    arrived: float = field(default_factory=time.monotonic)


def check_request(req: Request, text_dim: int, channels: int | None = None) -> None:
    """Raise ValueError naming the request field a rollout cannot work with."""
    who = f"request {req.prompt_id!r}"
    if req.sampler not in KINDS:
        raise ValueError(f"{who}: sampler={req.sampler!r}; expected one of {KINDS}")
    if len(req.img_fhw) != 3 or any(not isinstance(d, int) or d < 1 for d in req.img_fhw):
        raise ValueError(f"{who}: img_fhw={req.img_fhw!r}; expected 3 positive integers")
    sigmas(req.num_steps, req.shift)  # validates num_steps and shift
    if req.sigmas is not None:
        s = list(req.sigmas)
        if len(s) != req.num_steps + 1 or s[-1] != 0 or not 0 < s[0] <= 1 or any(a <= b for a, b in zip(s, s[1:])):
            raise ValueError(f"{who}: sigmas={tuple(s)!r}; expected num_steps + 1 = {req.num_steps + 1} strictly "
                             f"decreasing values from (0, 1] down to 0")
    if req.sampler != "ode" and not req.noise_level > 0:
        raise ValueError(f"{who}: noise_level={req.noise_level!r} with sampler {req.sampler!r}; expected > 0 "
                         f"(use sampler='ode' for deterministic steps)")
    if req.log_prob_form not in LOG_PROB_FORMS or (req.log_prob_form == "simple" and req.sampler != "cps"):
        raise ValueError(f"{who}: log_prob_form={req.log_prob_form!r}; expected 'gaussian', or 'simple' with "
                         f"sampler 'cps'")
    if req.cfg_rescale not in CFG_RESCALES:
        raise ValueError(f"{who}: cfg_rescale={req.cfg_rescale!r}; expected one of {CFG_RESCALES}")
    _check_window(req, who)
    for name in ("prompt_emb", "negative_prompt_emb"):
        emb = getattr(req, name)
        if emb is not None and (emb.dim() != 2 or emb.shape[1] != text_dim):
            raise ValueError(f"{who}: {name} has shape {tuple(emb.shape)}; expected [T, {text_dim}]")
    ctx = req.context_latents
    if ctx is not None:
        _, h, w = req.img_fhw
        if ctx.dim() != 2 or (channels is not None and ctx.shape[1] != channels) or ctx.shape[0] < 1 \
                or ctx.shape[0] % (h * w):
            raise ValueError(f"{who}: context_latents has shape {tuple(ctx.shape)}; expected [S_c, "
                             f"{channels if channels is not None else 'C'}] with S_c a positive multiple of the "
                             f"grid's h * w = {h} * {w} = {h * w} (whole frames of img_fhw={tuple(req.img_fhw)})")


def context_fhw(img_fhw: tuple[int, int, int], context_tokens: int) -> tuple[int, int, int]:
    """The forward's grid when ``context_tokens`` fixed tokens (whole frames) follow the sampled ``img_fhw``."""
    f, h, w = img_fhw
    return f + context_tokens // (h * w), h, w


def _check_window(req: Request, who: str) -> None:
    n = req.num_steps
    if req.window_size is None:
        last_trained = n - 1  # every step is trained
    else:
        lo, hi = req.window_range if req.window_range is not None else (0, max(n - req.window_size, 0))
        check_window(n, req.window_size, (lo, hi))
        if req.window_start is not None:
            sde_window(n, req.window_size, (lo, hi), start=req.window_start)  # validates the start
            lo = hi = req.window_start
        last_trained = hi + req.window_size - 1
    if req.sampler == "cps" and req.log_prob_form == "gaussian" and last_trained >= n - 1:
        raise ValueError(f"{who}: CPS's last step (t' = 0) has std 0, so its Gaussian log-prob is undefined; keep "
                         f"the SDE window off the last step or use log_prob_form='simple'")


class _WeightStager:
    """Streams HF-named tensors into Megatron tensors through the mapping table, validating each one;
    a fused QKV rule buffers its q / k / v (any order) only until its last part arrives."""

    def __init__(self, rules: list[Rule], params: dict[str, torch.nn.Parameter], heads: int, tp_rank: int,
                 tp_size: int, model_name: str = "model"):
        self.by_hf = {h: r for r in rules for h in r.hf}
        glob = {r.mcore: tuple(s * (tp_size if d == r.tp_dim else 1) for d, s in enumerate(params[r.mcore].shape))
                for r in rules}
        self.hf_shape = hf_shapes(rules, glob)
        self.params, self.heads, self.tp_rank, self.tp_size = params, heads, tp_rank, tp_size
        self.model_name = model_name
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}  # mcore name -> parts received so far
        self.staged: dict[str, torch.Tensor] = {}
        self.seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        rule = self.by_hf.get(name)
        if rule is None:
            raise ValueError(f"load_weights: tensor {name!r} is not a parameter of this {self.model_name}")
        if name in self.seen:
            raise ValueError(f"load_weights: tensor {name!r} was given twice")
        if tuple(tensor.shape) != self.hf_shape[name] or not tensor.is_floating_point():
            raise ValueError(f"load_weights: tensor {name!r} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                             f"expected shape {self.hf_shape[name]}, floating point")
        self.seen.add(name)
        # a copy: senders reuse their bucket buffers once the pair is consumed, as vLLM's loaders allow
        target = self.params[rule.mcore]
        parts = self.waiting.setdefault(rule.mcore, {})
        parts[name] = tensor.detach().to(device=target.device, dtype=target.dtype, copy=True)
        if len(parts) == len(rule.hf):
            full = to_mcore(rule, parts.__getitem__, self.heads)
            self.staged[rule.mcore] = tp_shard(full, rule.tp_dim, self.tp_rank, self.tp_size)
            del self.waiting[rule.mcore]

    def finish(self) -> dict[str, torch.Tensor]:
        if self.waiting:
            mcore, parts = next(iter(self.waiting.items()))
            missing = [h for h in self.by_hf if self.by_hf[h].mcore == mcore and h not in parts]
            raise ValueError(f"load_weights: {len(self.waiting)} fused tensor(s) incomplete, e.g. {mcore!r} still "
                             f"waits for {missing}")
        return self.staged


class EmbeddedEngine:
    """In-process rollout engine on any family's denoiser (``model_specs.family``: the family of ``arch``), TP=1
    by default.  A model sharded over ranks (its TP shard ``tp_rank`` of ``tp_size``, or its image tokens split
    over a CP group) runs every forward with the other ranks of ``groups`` (its TP and CP groups): each of them
    must call ``generate`` with the same requests, in the same order (checked: a digest of the requests is compared
    over ``groups`` at every call), and then draws the same random numbers (each request's own generators).  The
    model runs in eval mode under ``torch.no_grad``; sampler math is float32 whatever the model dtype."""

    def __init__(self, model: torch.nn.Module, arch, encode_prompts: EncodeFn | None = None,
                 config: EngineConfig | None = None, tp_rank: int = 0, tp_size: int = 1,
                 initial_noise: NoiseFn | None = None, groups: Sequence = ()):
        self.config = config or EngineConfig()
        self.config.check_engine()
        self.family: ModelFamily = family_of(arch)
        self.channels, self.text_dim = self.family.latent_channels(arch), self.family.text_dim(arch)
        self.model, self.arch, self.encode_prompts = model.eval(), arch, encode_prompts
        self.initial_noise = initial_noise
        first = next(model.parameters())
        self._device, self._dtype = first.device, first.dtype
        if self.config.fp8:
            check_fp8_device(self._device)
        # (before the fusions: an epilogue yields to FP8, and to a merged adapter)
        self.fp8 = enable_fp8(model, fast_accum=self.config.fp8_fast_accum) if self.config.fp8 else 0
        self.merged = merge_adapters(model) if self.config.merges_lora(self._device.type) else 0
        self.fused = fuse_inference(model) if self.config.fuse else 0
        self.adaln_fp8 = enable_adaln_fp8(model, self.config.fp8_adaln_kernel and bool(self.fp8 and self.fused))
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.groups = [g for g in groups if g is not None and g.size() > 1]  # ranks that run each forward together
        self._prompt_cache: dict[str, tuple[torch.Tensor, TextExtras]] = {}  # prompt -> (real tokens [T, E], extras)
        self._run_lock = threading.Lock()  # one batch (or weight load) at a time
        self._cv = threading.Condition()  # guards the submit() queue below
        self._pending: list[tuple[_Prepared, Future]] = []
        self._worker: threading.Thread | None = None
        self._closed = False
        self._asleep = False
        self._incomplete: str | None = None  # why the weights are part old, part new (a write that failed midway)
        self._graph_stream = None  # where cuda_graphs captures (one stream: its library workspaces outlive a batch)

    # ---- requests -> batches ------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Trajectory]:
        """Trajectories in request order; compatible requests share forwards, up to max_num_seqs each."""
        if self.groups:
            check_same_requests(requests, self.groups)
        prepared = self._prepare(requests)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p.key, []).append(i)
        out: list[Trajectory | None] = [None] * len(prepared)
        step = self.config.max_num_seqs
        for idx in groups.values():
            for c in range(0, len(idx), step):
                chunk = idx[c:c + step]
                for i, traj in zip(chunk, self._run([prepared[i] for i in chunk])):
                    out[i] = traj
        return out

    def submit(self, request: Request) -> Future:
        """Queue one request; a worker thread runs it once max_num_seqs compatible requests wait or
        ``wait_ms`` has passed since it arrived.  The future gives its Trajectory."""
        if self.groups:  # its batches depend on arrival times, which no two ranks share
            raise RuntimeError("submit() on an engine sharded over ranks: its batches follow arrival times, which "
                               "differ between ranks; expected generate() with the same requests on every rank")
        (prepared,) = self._prepare([request])
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("submit() on a closed EmbeddedEngine")
            self._pending.append((prepared, future))
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="rollout-engine", daemon=True)
                self._worker.start()
            self._cv.notify()
        return future

    def close(self) -> None:
        """Run what is queued, then stop the submit() worker."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._worker is not None:
            self._worker.join()

    def _serve(self) -> None:
        while True:
            with self._cv:
                batch = self._next_batch_locked()
            if batch is None:
                return
            try:
                for (_, future), traj in zip(batch, self._run([p for p, _ in batch])):
                    future.set_result(traj)
            except Exception as e:  # the callers see it through their futures
                for _, future in batch:
                    future.set_exception(e)

    def _next_batch_locked(self) -> list[tuple[_Prepared, Future]] | None:
        while not self._pending:
            if self._closed:
                return None
            self._cv.wait()
        head = self._pending[0][0]
        deadline = head.arrived + self.config.wait_ms / 1e3
        while True:
            same = [e for e in self._pending if e[0].key == head.key][:self.config.max_num_seqs]
            left = deadline - time.monotonic()
            if len(same) == self.config.max_num_seqs or left <= 0 or self._closed:
                break
            self._cv.wait(left)
        taken = {id(e) for e in same}
        self._pending = [e for e in self._pending if id(e) not in taken]
        return same

    # ---- text ------------------------------------------------------------------------------------
    def _prepare(self, requests: Sequence[Request]) -> list[_Prepared]:
        for r in requests:
            check_request(r, self.text_dim, self.channels)
        needed = [r.prompt for r in requests if r.prompt_emb is None]
        needed += [r.negative_prompt for r in requests if r.cfg and r.negative_prompt_emb is None]
        self._encode_missing(list(dict.fromkeys(t for t in needed if t not in self._prompt_cache)))
        return [self._prepared(r) for r in requests]

    def _encode_missing(self, texts: list[str]) -> None:
        if not texts:
            return
        if self.encode_prompts is None:
            raise ValueError(f"prompt {texts[0]!r} has no embeddings and the engine has no encode_prompts")
        emb_NTE, mask_NT, extras = split_encoding(self.encode_prompts(texts))
        e = self.text_dim
        if emb_NTE.dim() != 3 or emb_NTE.shape[0] != len(texts) or emb_NTE.shape[2] != e \
                or tuple(mask_NT.shape) != tuple(emb_NTE.shape[:2]):
            raise ValueError(f"encode_prompts gave emb {tuple(emb_NTE.shape)}, mask {tuple(mask_NT.shape)} for "
                             f"{len(texts)} prompts; expected [{len(texts)}, T, {e}] and [{len(texts)}, T]")
        for n, (text, emb_TE, mask_T) in enumerate(zip(texts, emb_NTE, mask_NT)):
            self._prompt_cache[text] = (real_tokens(emb_TE, mask_T, text),
                                        {k: v[n].detach().clone() for k, v in extras.items()})

    def _prepared(self, r: Request) -> _Prepared:
        parts = [(real_tokens(r.prompt_emb, r.prompt_mask, r.prompt), r.prompt_extras or {})
                 if r.prompt_emb is not None else self._prompt_cache[r.prompt]]
        if r.cfg:
            parts.append((real_tokens(r.negative_prompt_emb, r.negative_prompt_mask, r.negative_prompt),
                          r.negative_prompt_extras or {})
                         if r.negative_prompt_emb is not None else self._prompt_cache[r.negative_prompt])
        texts = []
        for part, extras in parts:
            (txt,), mask = pad_rows([part], padded_length([part.shape[0]], self.config.text_pad_multiple))
            texts.append((txt.to(self._device), None if mask is None else mask[0].to(self._device),
                          {k: v.to(self._device) for k, v in extras.items()}))
        cfg = (r.guidance_scale, r.cfg_rescale) if r.cfg else None
        schedule = None if r.sigmas is None else tuple(float(v) for v in r.sigmas)
        key = (tuple(r.img_fhw), r.num_steps, float(r.shift), schedule, r.sampler, float(r.noise_level), cfg,
               r.log_prob_form, tuple((txt.shape[0], mask is not None, tuple((k, tuple(v.shape)) for k, v in
                                                                          sorted(extras.items())))
                                      for txt, mask, extras in texts),
               None if r.context_latents is None else tuple(r.context_latents.shape))
        return _Prepared(r, key, texts)

    # ---- one batch -------------------------------------------------------------------------------
    def _run(self, items: list[_Prepared]) -> list[Trajectory]:
        r0 = items[0].request
        with self._run_lock, torch.no_grad():
            if self._asleep:
                raise RuntimeError("the engine is asleep (weights offloaded); call wake() before generating")
            if self._incomplete:
                raise RuntimeError(f"the engine's weights are incomplete: {self._incomplete}; it generates again "
                                   f"after a weight load of the whole model succeeds")
            if self.fp8 or self.merged:
                refresh_rollout_weights(self.model)  # rebuilds only the copies whose weights changed
            if self.fused:
                refresh_fused(self.model)  # the weights may have changed since the last batch
            sigmas_N1 = sigmas(r0.num_steps, r0.shift) if r0.sigmas is None else \
                torch.tensor(r0.sigmas, dtype=torch.float32)
            gens = [torch.Generator().manual_seed(p.request.seed) for p in items]
            windows = [_trained_steps(p.request, g) for p, g in zip(items, gens)]
            shape_X = (r0.img_fhw[0] * r0.img_fhw[1] * r0.img_fhw[2], self.channels)
            noise = self.initial_noise or (lambda g, fhw: torch.randn(shape_X, generator=g))
            x_BX = torch.stack([noise(g if p.request.noise_seed is None else
                                      torch.Generator().manual_seed(p.request.noise_seed), r0.img_fhw).float()
                                for p, g in zip(items, gens)])
            trained_BN = torch.stack([mask for mask, _ in windows])
            noise_fn = drawn_noise(gens, shape_X, trained_BN, self._device)  # the generators' last draws
            x_BX, sig_dev = to_device(x_BX, self._device), to_device(sigmas_N1, self._device)
            kept = [[] for _ in items]  # per request: its trained steps' uncond outputs, in step order
            velocity_fn = self._velocity_fn(items, sig_dev, _uncond_recorder(items, trained_BN, kept))
            lat, lp = rollout(velocity_fn, x_BX, sig_dev, r0.sampler, r0.noise_level, trained_BN, noise_fn,
                              r0.log_prob_form)
        return [Trajectory(p.request, lat[b], sigmas_N1, lp[b], trained_BN[b], windows[b][1],
                           torch.stack(kept[b]) if kept[b] else None)
                for b, p in enumerate(items)]

    def _velocity_fn(self, items: list[_Prepared], sigmas_N1: torch.Tensor,
                     on_uncond: Callable[[int, torch.Tensor], None] | None = None) -> Callable:
        """v(x_BX, i) at t = sigmas[i] over the batch (with CFG: cond rows, then uncond rows); ``on_uncond(i,
        v_uncond_BX)`` sees each step's uncond output.  Cond and uncond rows share one forward when their text
        has one layout (length and masking); else each branch runs its own forward, unpadded, unmasked."""
        r0 = items[0].request
        # (text [B, L_j, E], mask [B, L_j] or None, extras {name: [B, ...]}) per branch: one layout per batch (its key)
        branches = []
        for j in range(len(items[0].texts)):
            txt = torch.stack([p.texts[j][0] for p in items]).to(self._device, self._dtype)
            masked = items[0].texts[j][1] is not None
            extras = {k: v.to(self._dtype) for k, v in stack_extras([p.texts[j][2] for p in items]).items()}
            branches.append((txt, torch.stack([p.texts[j][1] for p in items]) if masked else None, extras))
        shared = len(branches) == 2 and branches[0][0].shape == branches[1][0].shape \
            and (branches[0][1] is None) == (branches[1][1] is None)
        if shared:  # [cond; uncond] rows of one forward
            (txt_c, mask_c, ext_c), (txt_u, mask_u, ext_u) = branches
            forwards = [(torch.cat([txt_c, txt_u]), None if mask_c is None else torch.cat([mask_c, mask_u]),
                         {k: torch.cat([ext_c[k], ext_u[k]]) for k in ext_c}, 2)]
        else:
            forwards = [(txt, mask, extras, 1) for txt, mask, extras in branches]

        steps = self.family.step_inputs(self.model, sigmas_N1[:-1])  # per-step conditioning, once per batch
        run = self._forward_fns(len(forwards))
        context_BSC, fhw = None, r0.img_fhw  # an edit's source tokens after the sampled ones, its own frames
        if r0.context_latents is not None:
            context_BSC = torch.stack([p.request.context_latents for p in items]).to(self._device, self._dtype)
            fhw = context_fhw(r0.img_fhw, context_BSC.shape[1])

        def velocity(x_BX: torch.Tensor, i: int) -> torch.Tensor:
            x = x_BX.to(self._dtype)
            n_img = x.shape[1]
            if context_BSC is not None:
                x = torch.cat([x, context_BSC], dim=1)
            with self._guards(i):
                outs = [fn(torch.cat([x] * rows) if rows > 1 else x, txt,
                           sigmas_N1[i].expand(rows * x.shape[0]), fhw, mask, **extras, **steps[i])
                        for fn, (txt, mask, extras, rows) in zip(run, forwards)]
            out = torch.cat(outs) if len(outs) > 1 else outs[0]
            if context_BSC is not None:
                out = out[:, :n_img]
            if not r0.cfg:
                return out.float()
            v_cond, v_uncond = out.chunk(2)
            if on_uncond is not None:
                on_uncond(i, v_uncond)
            return cfg_combine(v_cond, v_uncond, r0.guidance_scale, r0.cfg_rescale)

        return velocity

    def _forward_fns(self, n: int) -> list[Callable]:
        """The denoiser's forward for each of a batch's ``n`` forward layouts: under ``cuda_graphs`` on a CUDA
        device whose forwards no other rank joins, each replayed as a CUDA graph from the batch's second step on
        (``megatron_omni.rollout.graphs``; the graphs share one memory pool and die with the batch); else the model."""
        if not (self.config.cuda_graphs and self._device.type == "cuda" and not self.groups):
            return [self.model] * n
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(self._device)
        pool = torch.cuda.graph_pool_handle()
        return [ReplayedForward(self.model, pool, self._graph_stream) for _ in range(n)]

    def _guards(self, step: int):
        """The compiled blocks' guard checks at denoising step ``step`` of a batch: full at its first step, then
        (``skip_repeat_guards``) only the guards that tell the compiled graphs apart -- every later step repeats the
        first one's calls with the same shapes, dtypes and flags, so no later step can need a graph the first did
        not compile or select (``torch.compiler.set_stance``'s condition for ``skip_guard_eval_unsafe``)."""
        if step == 0 or not self.config.skip_repeat_guards:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

    # ---- weights and memory ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Receive (HF name, tensor) pairs as vLLM's loaders do, in any order (q / k / v of a fused QKV
        too), through the mapping table.  Every tensor is validated before any is copied: an unknown
        name, a duplicate, a wrong shape or an incomplete QKV raises ValueError naming the tensor and
        leaves the weights untouched.  A subset of the model may be sent.  Returns the Megatron names set.
        Until the copy it holds one converted copy of what it received, on the model's device and dtype.

        ``weights`` that know a faster way in (a ``load_into(engine)`` method: megatron_omni.sync's
        bucket stream, whose plan was validated before any byte moved) load themselves through
        ``weight_views`` and ``writing_weights``, straight into the parameters."""
        load_into = getattr(weights, "load_into", None)
        if load_into is not None:
            return load_into(self)
        params = base_tensors(self.model)  # parameters and buffers (a position table) the table names
        rules = self.family.rules(self.arch)
        stager = _WeightStager(rules, params, self.family.num_heads(self.arch), self.tp_rank, self.tp_size,
                               self.family.transformer_class)
        for name, tensor in weights:
            stager.add(name, tensor)
        staged = stager.finish()
        with self.writing_weights("load_weights", complete=len(staged) == len(rules)):
            for name, tensor in staged.items():
                params[name].copy_(tensor)
        return set(staged)

    def weight_views(self) -> dict:
        """Per HF name: (the view of this rank's parameter that tensor fills, a function giving the matching
        view of the whole HF tensor); per fused QKV also under the tuple of its three names, for q, k, v
        stacked.  See ``checkpoints_convert.mapping.hf_views``.  Copy under ``writing_weights``."""
        params, heads = base_tensors(self.model), self.family.num_heads(self.arch)
        out = {}
        for rule in self.family.rules(self.arch):
            out.update(hf_views(rule, params[rule.mcore].data, heads, self.tp_rank, self.tp_size))
        return out

    @contextlib.contextmanager
    def writing_weights(self, what: str, complete: bool) -> Iterator[None]:
        """Hold the engine (no batch runs) while weights are written in place.  If the writer fails midway
        the model is part old, part new: generate() then refuses, naming ``what``, until a write with
        ``complete`` (every parameter of the model) succeeds."""
        with self._run_lock, torch.no_grad():
            try:
                yield
            except BaseException as e:
                self._incomplete = f"{what} failed after writing part of them ({type(e).__name__}: {e})"
                raise
            if complete:
                self._incomplete = None

    def park(self) -> None:
        """Free what the engine rebuilds from the next weights anyway (the merged adapters' weight copies) while the
        trainer runs; the next batch rebuilds it."""
        with self._run_lock:
            if self.merged:
                drop_rollout_weights(self.model, merged_only=True)

    def sleep(self) -> None:
        """Offload the weights to host memory and free the accelerator's cached memory (for the trainer's
        phase).  On CPU there is nothing to free: a no-op, and generate() keeps working."""
        with self._run_lock:
            if self._device.type == "cpu" or self._asleep:
                return
            self.model.to("cpu")
            drop_rollout_weights(self.model)  # (rebuilt at the next batch)
            getattr(torch, self._device.type).empty_cache()
            self._asleep = True

    def wake(self) -> None:
        """Bring the weights back to the device after sleep(); a no-op on CPU or when awake."""
        with self._run_lock:
            if self._asleep:
                self.model.to(self._device)
                self._asleep = False


def requests_digest(requests: Sequence[Request]) -> str:
    """A digest of what decides the requests' samples: every field, a tensor by its shape, dtype and bytes."""
    import hashlib
    from dataclasses import fields

    h = hashlib.blake2b(digest_size=16)
    for r in requests:
        for f in fields(r):
            value = getattr(r, f.name)
            if isinstance(value, dict):  # text extras
                value = sorted(value.items())
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], torch.Tensor):
                    h.update(v[0].encode())
                    v = v[1]
                if isinstance(v, torch.Tensor):
                    t = v.detach().cpu().contiguous()
                    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
                    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                else:
                    h.update(repr(v).encode())
    return h.hexdigest()


def check_same_requests(requests: Sequence[Request], groups: Sequence) -> None:
    """RuntimeError unless every rank of each of ``groups`` was given the same requests (by digest): the ranks of a
    sharded engine run each forward together, so different requests would mix their samples or hang."""
    import torch.distributed as dist

    mine = requests_digest(requests)
    for group in groups:
        digests = [None] * group.size()
        dist.all_gather_object(digests, (mine, len(requests)), group=group)
        if any(d != digests[0] for d in digests):
            ranks = dist.get_process_group_ranks(group)
            raise RuntimeError(f"sharded rollout engine: the ranks {ranks} of one engine were given different "
                               f"requests ((digest, count) per rank: {digests}); expected the same requests, in the "
                               f"same order, on every rank of its TP / CP group")


def _uncond_recorder(items: list[_Prepared], trained_BN: torch.Tensor,
                     kept: list[list[torch.Tensor]]) -> Callable[[int, torch.Tensor], None] | None:
    """``on_uncond`` that appends, for each request asking for it, its uncond output at its trained steps
    (float32 copies: a view would keep the whole batch's output alive); None when no request asks."""
    keep_B = torch.tensor([p.request.keep_uncond_velocity and p.request.cfg for p in items])
    if not bool(keep_B.any()):
        return None

    def record(i: int, v_uncond_BX: torch.Tensor) -> None:
        for b in torch.nonzero(keep_B & trained_BN[:, i].cpu()).flatten().tolist():
            kept[b].append(v_uncond_BX[b].to(torch.float32, copy=True))

    return record


def _trained_steps(req: Request, generator: torch.Generator) -> tuple[torch.Tensor, int | None]:
    """[N] bool mask of trained (SDE) steps and the window start; draws the start from the request's
    generator when the window has no given start."""
    n = req.num_steps
    if req.sampler == "ode":
        return torch.zeros(n, dtype=torch.bool), None
    if req.window_size is None:
        return torch.ones(n, dtype=torch.bool), None
    return sde_window(n, req.window_size, req.window_range, generator, req.window_start)
