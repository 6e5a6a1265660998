"""Exporter: a (TP/PP-sharded) Megatron model -> whole HF-named tensors, gathered bucket by bucket.

Protocol: ``plan()`` (no communication, no copies) lists what ``tensors()`` will yield, in order:
(HF name, shape, dtype).  ``tensors()`` is a collective over the TP group (every TP rank of the stage
iterates it; all of them receive the gathered tensors, the stage's sender uses them).  Per bucket,
the TP-split local shards of consecutive rules are packed into one flat buffer and all-gathered once,
so extra memory is about ``bucket_bytes`` x (TP + 1) and the number of collectives is the number of
buckets, not of tensors.

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
from checkpoints_convert.qwen_image import BLOCK_RULES, GLOBAL_RULES
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
        self.heads = self.arch.num_attention_heads
        self.lora = lora_modules(module)
        if mode == "lora" and not self.lora:
            raise ValueError("export mode 'lora' needs a model with LoRA adapters (model_specs.common.lora.apply_lora)")
        self.local = {target_name(k): v for k, v in module.state_dict(keep_vars=True).items()
                      if not k.endswith((".lora_A", ".lora_B"))}
        self.items = self._adapter_items() if mode == "lora" else self._rule_items(pp_group)

    # ---- what is exported ----------------------------------------------------------------------
    def _rule_items(self, pp_group) -> list[_Item]:
        local_globals = [r.mcore for r in GLOBAL_RULES if r.mcore in self.local]
        owned = set(local_globals)
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            held = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(held, local_globals, group=pp_group)
            earlier = {n for names in held[:dist.get_rank(pp_group)] for n in names}
            owned -= earlier
        items = [_Item(r.mcore, r, None, r.tp_dim) for r in GLOBAL_RULES if r.mcore in owned]
        for i in sorted(int(name) for name, _ in self.module.blocks.named_children()):
            items += [_Item(rule.mcore, rule, None, rule.tp_dim) for rule in (r.expand(i) for r in BLOCK_RULES)]
        return items

    def _adapter_items(self) -> list[_Item]:
        return [_Item(f"{mod}:{name}", None, name, dim) for mod, m in self.lora.items()
                for name, _, dim in m.peft_tensors()]

    def _local_tensor(self, item: _Item) -> torch.Tensor:
        if item.rule is None:
            mod, _, name = item.local_name.partition(":")
            return next(t for n, t, _ in self.lora[mod].peft_tensors() if n == name).detach()
        t = self.local[item.local_name].detach()
        mod = item.local_name.removesuffix(".weight")
        if self.mode == "merged" and item.local_name.endswith(".weight") and mod in self.lora:
            t = t + self.lora[mod].delta_weight().detach().to(t.dtype)
        return t

    def _global_shape(self, item: _Item) -> tuple[int, ...]:
        shape = list(self._local_tensor_shape(item))
        if item.tp_dim is not None:
            shape[item.tp_dim] *= self.tp_size
        return tuple(shape)

    def _local_tensor_shape(self, item: _Item) -> tuple[int, ...]:
        if item.rule is None:
            return tuple(self._local_tensor(item).shape)
        return tuple(self.local[item.local_name].shape)

    def plan(self) -> list[TensorMeta]:
        """The tensors ``tensors()`` yields, in order, without gathering anything."""
        out = []
        for item in self.items:
            dtype = self.local[item.local_name].dtype if item.rule else self._local_tensor(item).dtype
            if item.rule is None:
                out.append(TensorMeta(item.hf_name, self._global_shape(item), dtype))
                continue
            shapes = hf_shapes([item.rule], {item.rule.mcore: self._global_shape(item)})
            out += [TensorMeta(h, tuple(shapes[h]), dtype) for h in item.rule.hf]
        return out

    # ---- the gather --------------------------------------------------------------------------------
    def _buckets(self) -> Iterator[list[_Item]]:
        bucket, size = [], 0
        for item in self.items:
            nbytes = torch.Size(self._global_shape(item)).numel() * self._local_tensor_dtype(item).itemsize
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(item)
            size += nbytes
        if bucket:
            yield bucket

    def _local_tensor_dtype(self, item: _Item) -> torch.dtype:
        return self.local[item.local_name].dtype if item.rule else self._local_tensor(item).dtype

    def _gather(self, items: list[_Item]) -> list[torch.Tensor]:
        """Whole (global) tensors of ``items``: one all-gather over TP for all the split ones."""
        local = [self._local_tensor(it) for it in items]
        split = [i for i, it in enumerate(items) if it.tp_dim is not None and self.tp_size > 1]
        if not split:
            return local
        dtype = local[split[0]].dtype
        if any(local[i].dtype != dtype for i in split):
            raise ValueError("HFExporter: TP-split tensors of one bucket have different dtypes")
        flat = torch.cat([local[i].reshape(-1) for i in split])  # [n]
        out = torch.empty(self.tp_size * flat.numel(), dtype=dtype, device=flat.device)
        dist.all_gather_into_tensor(out, flat, group=self.tp_group)
        out_TN = out.view(self.tp_size, -1)  # [TP, n]
        start = 0
        for i in split:
            n, shape, dim = local[i].numel(), local[i].shape, items[i].tp_dim
            local[i] = torch.cat([out_TN[r, start:start + n].view(shape) for r in range(self.tp_size)], dim=dim)
            start += n
        return local

    @torch.no_grad()
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) in ``plan()`` order; a collective over the TP group.  The tensors may
        be views of a buffer reused for the next bucket: consume (copy) each before asking for the next."""
        for items in self._buckets():
            for item, full in zip(items, self._gather(items)):
                if item.rule is None:
                    yield item.hf_name, full
                else:
                    yield from to_hf(item.rule, full, self.heads)
