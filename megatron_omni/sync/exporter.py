"""Exporter: a (TP/PP-sharded) Megatron model -> whole HF-named tensors, gathered bucket by bucket.

Protocol: ``plan()`` (no communication, no copies) lists what ``tensors()`` will yield, in order:
(HF name, shape, dtype).  Build one exporter and reuse it for every sync: the items, the plan, the
bucket split and the source tensor of every item (a parameter, or an adapter view ``lora_A[j]``) are
resolved once.  The optimizer updates parameters in place (megatron-core's DDP re-binds ``param.data``
only when it is built, and only with the distributed optimizer), so the references stay valid; should
a parameter be re-bound later (``module.to()``, an offload), the next call notices (the parameters'
data pointers changed) and resolves everything again.

``tensors()`` is a collective over the TP group (every TP rank of the stage iterates it; all of them
receive the gathered tensors, the stage's sender uses them).  Per bucket,
the TP-split local shards of consecutive rules are packed into one flat buffer and all-gathered once,
so extra memory is about ``bucket_bytes`` x (TP + 1) and the number of collectives is the number of
buckets, not of tensors.

``shards()`` yields this rank's own tensors instead, under Megatron names (peft names for adapters), without
any gather: for an in-process engine sharded as the policy is (the same TP size and rank), which copies them as
they are.

Modes: "full" (the base weights as held), "merged" (LoRA folded in: W + alpha/r B A, one rule at a
time) and "lora" (the adapters only, under peft's names).

Pipeline parallelism: each stage exports the blocks it holds (``module.blocks`` children are named by
global block index at any PP) and the global tensors that no earlier stage of ``pp_group`` holds (the
timestep embedder is replicated on every stage), so the stages' plans are disjoint and together name
every tensor once; each stage's sender streams its own plan (``broadcaster.send_weights``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from checkpoints_convert.mapping import Rule, hf_shapes, to_hf
from model_specs.family import family_of
from model_specs.common.lora import lora_modules, target_name

MODES = ("full", "merged", "lora")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class _Item:
    """One gathered unit: a Megatron rule (full / merged) or one adapter matrix (lora)."""
    local_name: str  # this rank's tensor name
    rule: Rule | None  # with global names; None for an adapter matrix
    hf_name: str | None  # adapter matrices only
    tp_dim: int | None


class HFExporter:
    """Yields this stage's tensors under HF (or peft) names; see the module docstring."""

    def __init__(self, module: torch.nn.Module, tp_group=None, pp_group=None, mode: str = "full",
                 bucket_bytes: int = 1 << 30):
        if mode not in MODES:
            raise ValueError(f"export mode {mode!r} is not one of {MODES}")
        self.module, self.arch, self.mode, self.bucket_bytes = module, module.arch, mode, bucket_bytes
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.family = family_of(self.arch)
        self.heads = self.family.num_heads(self.arch)
        self.lora = lora_modules(module)
        if mode == "lora" and not self.lora:
            raise ValueError("export mode 'lora' needs a model with LoRA adapters (model_specs.common.lora.apply_lora)")
        self.local = {target_name(k): v for k, v in module.state_dict(keep_vars=True).items()
                      if not k.endswith((".lora_A", ".lora_B"))}
        self.items = self._adapter_items() if mode == "lora" else self._rule_items(pp_group)
        # the parameters the sources are views of: their data pointers tell whether a source went stale
        self._params = [p for m in self.lora.values() for p in (m.lora_A, m.lora_B)] if mode == "lora" else \
            [self.local[it.local_name] for it in self.items]
        self._merge = [self.lora.get(it.local_name.removesuffix(".weight")) if mode == "merged"
                       and it.local_name.endswith(".weight") else None for it in self.items]
        self._fingerprint: tuple[int, ...] | None = None

    # ---- what is exported ----------------------------------------------------------------------
    def _rule_items(self, pp_group) -> list[_Item]:
        global_rules = self.family.global_rules()
        local_globals = [r.mcore for r in global_rules if r.mcore in self.local]
        owned = set(local_globals)
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            held = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(held, local_globals, group=pp_group)
            earlier = {n for names in held[:dist.get_rank(pp_group)] for n in names}
            owned -= earlier
        items = [_Item(r.mcore, r, None, r.tp_dim) for r in global_rules if r.mcore in owned]
        for i in sorted(int(name) for name, _ in self.module.blocks.named_children()):
            items += [_Item(rule.mcore, rule, None, rule.tp_dim) for rule in self.family.block_rules(self.arch, i)]
        return items

    def _adapter_items(self) -> list[_Item]:
        return [_Item(f"{mod}:{name}", None, name, dim) for mod, m in self.lora.items()
                for name, _, dim in m.peft_tensors()]

    def _resolve(self) -> None:
        """Source tensor, plan and bucket split, computed again only when a parameter was re-bound."""
        fingerprint = tuple(p.data_ptr() for p in self._params)
        if fingerprint == self._fingerprint:
            return
        if self.mode == "lora":  # same order as _adapter_items
            self._sources = [t.detach() for m in self.lora.values() for _, t, _ in m.peft_tensors()]
        else:
            self._sources = [self.local[it.local_name].detach() for it in self.items]
        self._plan = tuple(self._make_plan())
        self._split = self._make_split()
        self._fingerprint = fingerprint

    def _global_shape(self, i: int) -> tuple[int, ...]:
        shape, dim = list(self._sources[i].shape), self.items[i].tp_dim
        if dim is not None:
            shape[dim] *= self.tp_size
        return tuple(shape)

    def plan(self) -> list[TensorMeta]:
        """The tensors ``tensors()`` yields, in order, without gathering anything (a new list of the same
        cached ``TensorMeta`` objects each call: the broadcaster compares it with the last one by identity
        of its items, in microseconds)."""
        self._resolve()
        return list(self._plan)

    def _make_plan(self) -> Iterator[TensorMeta]:
        for i, item in enumerate(self.items):
            dtype, shape = self._sources[i].dtype, self._global_shape(i)
            if item.rule is None:
                yield TensorMeta(item.hf_name, shape, dtype)
                continue
            shapes = hf_shapes([item.rule], {item.rule.mcore: shape})
            yield from (TensorMeta(h, tuple(shapes[h]), dtype) for h in item.rule.hf)

    # ---- the gather --------------------------------------------------------------------------------
    def _make_split(self) -> list[list[int]]:
        """Item indices per gather bucket (about ``bucket_bytes`` of whole tensors each)."""
        buckets, size = [[]], 0
        for i in range(len(self.items)):
            nbytes = torch.Size(self._global_shape(i)).numel() * self._sources[i].dtype.itemsize
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return [b for b in buckets if b]

    def _local_tensor(self, i: int) -> torch.Tensor:
        t, lora = self._sources[i], self._merge[i]
        if lora is not None:  # merged: W + alpha/r B A, a fresh tensor
            t = t + lora.delta_weight().detach().to(t.dtype)
        return t

    @torch.no_grad()
    def _gather(self, idx: list[int]) -> list[torch.Tensor]:
        """Whole (global) tensors of items ``idx``: one all-gather over TP for all the split ones."""
        local = [self._local_tensor(i) for i in idx]
        split = [j for j, i in enumerate(idx) if self.items[i].tp_dim is not None and self.tp_size > 1]
        if not split:
            return local
        dtype = local[split[0]].dtype
        if any(local[j].dtype != dtype for j in split):
            raise ValueError("HFExporter: TP-split tensors of one bucket have different dtypes")
        flat = torch.cat([local[j].reshape(-1) for j in split])  # [n]
        out = torch.empty(self.tp_size * flat.numel(), dtype=dtype, device=flat.device)
        dist.all_gather_into_tensor(out, flat, group=self.tp_group)
        out_TN = out.view(self.tp_size, -1)  # [TP, n]
        start = 0
        for j in split:
            n, shape, dim = local[j].numel(), local[j].shape, self.items[idx[j]].tp_dim
            local[j] = torch.cat([out_TN[r, start:start + n].view(shape) for r in range(self.tp_size)], dim=dim)
            start += n
        return local

    def shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name, or peft name for an adapter matrix; this rank's tensor) per item, no communication: a
        parameter (or adapter view) itself, or a fresh merged weight.  For a receiver holding the same TP shard."""
        self._resolve()
        with torch.no_grad():
            for i, item in enumerate(self.items):
                yield (item.hf_name if item.rule is None else item.local_name), self._local_tensor(i)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) in ``plan()`` order; a collective over the TP group.  Every tensor stays
        valid while it is referenced: it is a parameter (or adapter view) itself, or freshly allocated
        (a TP gather, a merged weight, a q / k / v split: three views of one copy), never a view of a
        buffer reused for a later bucket.  So a consumer may hold a bucket's worth before copying them
        (the broadcaster packs a bucket with one fused copy); the parameters must not change until the
        sync ends.  (No grad-mode decorator here: on a generator it toggles grad mode at every yield;
        ``_gather`` computes under ``no_grad`` and the q / k / v split works on tensors that need no grad.)"""
        self._resolve()
        for idx in self._split:
            for i, full in zip(idx, self._gather(idx)):
                item = self.items[i]
                if item.rule is None:
                    yield item.hf_name, full
                else:
                    yield from to_hf(item.rule, full, self.heads, share_storage=True)  # q / k / v: one copy
