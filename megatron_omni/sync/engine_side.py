"""What the receiving side needs from an ``EmbeddedEngine``: the expected shapes per mode, the load
itself and the tensors it holds afterwards, for the checksum.

Loads of a sync stream (``broadcaster.Incoming``), with everything per tensor computed once per plan
digest and reused while the digests and the engine's parameters stay the same:
* LoRA adapters: the whole stream lands in one resident staging buffer (the adapters are small); once
  every bucket has arrived, one fused copy moves them into the engine's adapter tensors (their TP
  shards).  A sync that fails midway leaves the adapters untouched.
* full / merged: straight from the buckets into (views of) the engine's parameters, q / k / v into
  strided views of the fused QKV, one fused copy per bucket: no staged copy of the model.  Names and
  shapes were checked before any byte moved; a peer that dies midway leaves the model part old, part
  new, and the engine then refuses to generate until a sync of the whole model succeeds
  (``EmbeddedEngine.writing_weights``).
Plain (name, tensor) pairs go the staged way (``engine.load_weights``, ``load_peft_state_dict``).
A policy's own shards (``HFExporter.shards``, for an engine sharded as the policy) go straight into the engine's
tensors of the same names (``load_shards``): no gather, no conversion.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch

from checkpoints_convert.convert import hf_state_from_mcore
from checkpoints_convert.mapping import hf_shapes
from megatron_omni.sync.broadcaster import Incoming
from megatron_omni.sync.exporter import TensorMeta
from megatron_omni.sync.stream import ALIGN, copy_groups, run_copies
from model_specs.common.lora import base_tensors, load_peft_state_dict, lora_modules, peft_state_dict


@dataclass
class _SyncState:
    """Per engine: the last plan checked, the number of syncs, the LoRA staging buffer and the copy plan
    of the last digests."""
    checked: tuple = (None, "", "")  # (plan tuple, mode, verdict)
    syncs: int = 0
    staging: torch.Tensor | None = None
    prepared: tuple = (None, None)  # (key, _LoraCommit or _DirectPlan)
    lora: dict = field(default_factory=dict)  # the engine model's LoRALinears, found once
    params: list = field(default_factory=list)  # and its parameters: their data pointers key the copy plans

    def fingerprint(self, adapters: bool) -> tuple[int, ...]:
        """Where the parameters live now (sleep / wake or ``.to()`` move them): copy plans hold views."""
        if adapters:
            return tuple(p.data_ptr() for m in self.lora.values() for p in (m.lora_A, m.lora_B))
        return tuple(p.data_ptr() for p in self.params)


_STATES: "weakref.WeakKeyDictionary[object, _SyncState]" = weakref.WeakKeyDictionary()


def _state(engine) -> _SyncState:
    if engine not in _STATES:
        _STATES[engine] = _SyncState(lora=lora_modules(engine.model), params=[*engine.model.parameters(), *engine.model.buffers()])
    return _STATES[engine]


def expected_shapes(engine, mode: str) -> dict[str, tuple[int, ...]]:
    model = engine.model
    if mode == "lora":
        return {name: tuple(t.shape) for m in lora_modules(model).values()
                for name, t, dim in _global_adapters(m)}
    params = base_tensors(model)  # an engine with LoRA applied holds its base under .base; buffers too
    rules = engine.family.rules(engine.arch)
    glob = {r.mcore: tuple(s * (engine.tp_size if d == r.tp_dim else 1) for d, s in enumerate(params[r.mcore].shape))
            for r in rules}
    return hf_shapes(rules, glob)


def _global_adapters(m):
    for name, t, dim in m.peft_tensors():
        shape = list(t.shape)
        if dim is not None:
            shape[dim] *= m.tp_size
        yield name, torch.empty(shape, device="meta"), dim


def check_plan(engine, mode: str, plan) -> str:
    """'' when every sent tensor is known with the right shape, else a message naming the first bad one.
    The verdict on a plan tuple is kept: the broadcaster passes the same tuple while its digest holds."""
    st = _state(engine)
    if isinstance(plan, tuple) and st.checked[0] is plan and st.checked[1] == mode:
        return st.checked[2]
    verdict = _check(engine, mode, plan)
    if isinstance(plan, tuple):
        st.checked = (plan, mode, verdict)
    return verdict


def _check(engine, mode: str, plan: Iterable[TensorMeta]) -> str:
    if mode == "lora" and not lora_modules(engine.model):
        return "LoRA-only sync, but the engine model has no LoRA adapters (apply_lora it like the trainer's)"
    expected = expected_shapes(engine, mode)
    for meta in plan:
        if meta.name not in expected:
            return f"tensor {meta.name!r} is not a parameter of the engine's model ({mode} sync)"
        if meta.shape != expected[meta.name]:
            return f"tensor {meta.name!r} has shape {meta.shape}; the engine expects {expected[meta.name]}"
        if not meta.dtype.is_floating_point:
            return f"tensor {meta.name!r} has dtype {meta.dtype}; expected floating point"
    return ""


def load(engine, mode: str, pairs) -> None:
    if not isinstance(pairs, Incoming):
        _load_pairs(engine, mode, pairs)
        return
    st = _state(engine)
    st.syncs += 1
    what = f"weight sync {st.syncs} ({mode}, plan {'+'.join(d[:12] for d in pairs.digests)})"
    if mode == "lora":
        _load_lora(engine, pairs, st)
    else:
        engine.load_weights(_DirectStream(pairs, st, what))


def _load_pairs(engine, mode: str, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    if mode != "lora":
        engine.load_weights(pairs)
        return
    state = {name: t.detach().clone() for name, t in pairs}  # the buckets are reused: copy on receipt
    with getattr(engine, "_run_lock", None) or contextlib.nullcontext():
        load_peft_state_dict(engine.model, state)


def load_shards(engine, mode: str, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy (name, tensor) pairs of a policy sharded as the engine is (its TP size and rank) into the engine's
    tensors of those names: Megatron names for full / merged weights, peft names for LoRA adapters.  Every pair is
    checked (a known name, given once, this rank's shape) before any is copied; returns the number copied."""
    if mode == "lora":
        held_now = {name: t for m in lora_modules(engine.model).values() for name, t, _ in m.peft_tensors()}
    else:
        held_now = base_tensors(engine.model)
    dst, src = [], []
    for name, t in pairs:
        if name not in held_now:
            kind = "LoRA adapter" if mode == "lora" else "parameter"
            raise ValueError(f"shard load ({mode}): tensor {name!r} is not a {kind} of the engine's model")
        target = held_now.pop(name)
        if t.shape != target.shape or not t.is_floating_point():
            raise ValueError(f"shard load ({mode}): tensor {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                             f"the engine's shard is {tuple(target.shape)}, floating point (at TP={engine.tp_size})")
        dst.append(target.detach())
        src.append(t.detach())
    if mode == "lora":
        with engine._run_lock, torch.no_grad():  # the adapters only: the base is the engine's own or shared
            run_copies(copy_groups(dst, src))
        return len(dst)
    rules = engine.family.rules(engine.arch)
    complete = not any(r.mcore in held_now for r in rules)
    with engine.writing_weights(f"shard load ({mode})", complete=complete):
        run_copies(copy_groups(dst, src))
    return len(dst)


def _prepared(st: _SyncState, key: tuple, build):
    if st.prepared[0] != key:
        st.prepared = (None, None)  # drop the old views before building the new ones
        st.prepared = (key, build())
    return st.prepared[1]


# ---- LoRA: stage the whole stream, then commit -----------------------------------------------------------

class _LoraCommit:
    """Where every sent adapter sits in the staging buffer, and the engine tensor (TP shard) it goes to."""

    def __init__(self, st: _SyncState, incoming: Incoming):
        self.bases, base = [], 0
        for plan in incoming.plans:  # sender s's stream at bases[s] of the staging buffer
            self.bases.append(base)
            base += -(-plan.total // ALIGN) * ALIGN
        adapters = [(m, name, t, dim) for m in st.lora.values() for name, t, dim in m.peft_tensors()]
        if not adapters:
            raise ValueError("LoRA-only sync, but the engine model has no LoRA adapters")
        device = adapters[0][2].device
        if st.staging is None or st.staging.numel() < base or st.staging.device != device:
            st.staging = None
            st.staging = torch.empty(base, dtype=torch.uint8, device=device)
        self.staging = st.staging
        sent = {}
        for plan, b in zip(incoming.plans, self.bases):
            for e in plan.entries:
                if e.meta.name in sent:
                    raise ValueError(f"adapter tensor {e.meta.name!r} was sent twice")
                at = b + e.offset
                sent[e.meta.name] = self.staging[at:at + e.meta.nbytes].view(e.meta.dtype).view(e.meta.shape)
        self.dst, self.src = [], []
        for m, name, local, dim in adapters:
            if name not in sent:
                raise KeyError(f"adapter tensor {name!r} missing from the sync ({len(sent)} tensors sent)")
            whole = sent.pop(name)
            part = whole if dim is None or m.tp_size == 1 else whole.chunk(m.tp_size, dim)[m.tp_rank]
            if part.shape != local.shape:
                raise ValueError(f"adapter tensor {name!r} has shape {tuple(whole.shape)}; expected "
                                 f"{tuple(local.shape)} per TP rank at TP={m.tp_size}")
            self.dst.append(local.detach())
            self.src.append(part)
        if sent:
            raise ValueError(f"adapter tensor {next(iter(sent))!r} is not an adapter of the engine's model")
        self.groups = copy_groups(self.dst, self.src)


def _load_lora(engine, incoming: Incoming, st: _SyncState) -> None:
    commit = _prepared(st, ("lora", incoming.digests, st.fingerprint(adapters=True)), lambda: _LoraCommit(st, incoming))
    staging = commit.staging
    for s, k, buf in incoming.buckets():
        at = commit.bases[s] + k * incoming.plans[s].bucket_bytes
        staging[at:at + buf.numel()].copy_(buf, non_blocking=staging.device.type != "cpu")
    # every bucket arrived: commit all adapters at once (a sync that failed above changed nothing)
    with getattr(engine, "_run_lock", None) or contextlib.nullcontext(), torch.no_grad():
        run_copies(commit.groups)


# ---- full / merged: straight into the parameters ---------------------------------------------------------

class _DirectPlan:
    """Per sent tensor, the view of the engine parameter it fills; per bucket, the fused copy's lists."""

    def __init__(self, engine, incoming: Incoming):
        views, rules = engine.weight_views(), engine.family.rules(engine.arch)
        sent = [e.meta.name for plan in incoming.plans for e in plan.entries]
        if len(set(sent)) != len(sent):
            raise ValueError(f"tensor {next(n for i, n in enumerate(sent) if n in sent[:i])!r} was sent twice")
        if unknown := [n for n in sent if n not in views]:
            raise ValueError(f"tensor {unknown[0]!r} is not a parameter of the engine's model")
        names = set(sent)
        for rule in rules:  # a fused QKV is written only whole, as load_weights requires
            if 0 < len(names.intersection(rule.hf)) < len(rule.hf):
                raise ValueError(f"fused tensor {rule.mcore!r} incomplete: got {sorted(names.intersection(rule.hf))} "
                                 f"of {list(rule.hf)}")
        self.complete = all(h in names for rule in rules for h in rule.hf)
        self.mcore = {rule.mcore for rule in rules if rule.hf[0] in names}
        self.targets = [[views[e.meta.name] for e in plan.entries] for plan in incoming.plans]
        self.stacked = [_stacked_qkv(plan, views) for plan in incoming.plans]
        self.inside = [plan.inside() for plan in incoming.plans]
        self.pieces = [plan.pieces() for plan in incoming.plans]
        self._copies: dict[tuple[int, int], tuple[list, list]] = {}  # (s, k) -> (bucket views, copy groups)

    def copy_bucket(self, incoming: Incoming, s: int, k: int, buf: torch.Tensor, partial: dict) -> None:
        views = incoming.views(s)
        cached = self._copies.get((s, k))
        if cached is None or cached[0] is not views:  # built once per bucket buffer pair
            cached = (views, self._copy_groups(incoming, s, k, views))
            self._copies[(s, k)] = cached
        run_copies(cached[1])
        entries = incoming.plans[s].entries
        for i, lo, hi, at in self.pieces[s].get(k, ()):  # tensors that straddle buckets: assembled first
            meta = entries[i].meta
            if (s, i) not in partial:
                partial[(s, i)] = torch.empty(meta.nbytes, dtype=torch.uint8, device=buf.device)
            partial[(s, i)][at:at + hi - lo].copy_(buf[lo:hi])
            if at + hi - lo == meta.nbytes:
                dst, take = self.targets[s][i]
                dst.copy_(take(partial.pop((s, i)).view(meta.dtype).view(meta.shape)))


    def _copy_groups(self, incoming: Incoming, s: int, k: int, views: list) -> list:
        """The copies of the tensors inside bucket k of sender s: a fused QKV whose q, k, v lie side by
        side in the bucket is one strided copy, every other tensor a copy of its own."""
        plan, inside = incoming.plans[s], self.inside[s].get(k, [])
        slot = incoming.channel.bucket_buffers(plan.bucket_bytes)[k % 2]
        members, taken, dst, src = set(inside), set(), [], []
        for i in inside:
            if i in taken:
                continue
            stacked = self.stacked[s].get(i)
            if stacked is not None and i + 2 in members:
                meta, start = plan.entries[i].meta, plan.entries[i].offset - k * plan.bucket_bytes
                qkv = slot[start:start + 3 * meta.nbytes].view(meta.dtype).view(3, *meta.shape)  # [3, H*D, ...]
                dst.append(stacked[0])
                src.append(stacked[1](qkv))
                taken.update((i + 1, i + 2))
                continue
            dst.append(self.targets[s][i][0])
            src.append(self.targets[s][i][1](views[i]))
        return copy_groups(dst, src)


def _stacked_qkv(plan, views: dict) -> dict[int, tuple]:
    """Entry index i -> the stacked view pair of a fused QKV (``hf_views``) whose q, k, v are entries
    i, i + 1, i + 2 lying side by side in the stream (no padding between them)."""
    at = {e.meta.name: i for i, e in enumerate(plan.entries)}
    out = {}
    for key, pair in views.items():
        if not isinstance(key, tuple) or key[0] not in at:
            continue
        i = at[key[0]]
        trio = plan.entries[i:i + 3]
        first = trio[0]
        if [e.meta.name for e in trio] == list(key) and all(
                (e.meta.dtype, e.meta.shape, e.offset) == (first.meta.dtype, first.meta.shape,
                                                           first.offset + j * first.meta.nbytes)
                for j, e in enumerate(trio)):
            out[i] = pair
    return out


class _DirectStream:
    """A full / merged sync stream for ``EmbeddedEngine.load_weights``: (name, tensor) pairs like any
    weights, or, through ``load_into``, copied straight from the buckets into the parameters."""

    def __init__(self, incoming: Incoming, st: _SyncState, what: str):
        self.incoming, self.st, self.what = incoming, st, what

    def __iter__(self):
        return iter(self.incoming)

    def load_into(self, engine) -> set[str]:
        incoming = self.incoming
        key = ("direct", incoming.digests, self.st.fingerprint(adapters=False))
        plan = _prepared(self.st, key, lambda: _DirectPlan(engine, incoming))
        buckets = incoming.buckets()
        first = next(buckets, None)  # nothing is written before a first bucket arrived
        if first is None:
            return set()
        with engine.writing_weights(self.what, complete=plan.complete):
            partial = {}
            for s, k, buf in itertools.chain([first], buckets):
                plan.copy_bucket(incoming, s, k, buf, partial)
        return set(plan.mcore)


def held(engine, mode: str) -> dict[str, torch.Tensor]:
    """The engine's tensors under the names the trainer sent (engine at TP=1)."""
    if mode == "lora":
        return peft_state_dict(engine.model)
    params = base_tensors(engine.model)
    return dict(hf_state_from_mcore(engine.arch, params.__getitem__))
