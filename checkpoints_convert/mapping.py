"""Declarative HF <-> Megatron parameter mapping: the rule type and the transforms it names.

A family's table is a list of ``Rule``s.  The table knows names, the tensor transform and which
Megatron dimension tensor parallelism splits; gathering across TP / PP ranks happens outside it.
The same table drives the convert CLI and the weight-sync exporter, so HF names exist in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

COPY, QKV = "copy", "qkv"


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of.

    mcore:  Megatron name; ``{i}`` is the block index.
    hf:     HF name(s); three for a fused QKV (q, k, v order).
    transform: COPY (same tensor) or QKV (per-head interleave of q, k, v along dim 0).
    tp_dim: dimension of the Megatron tensor split over TP ranks (0 column-parallel, 1 row-parallel),
            None when every TP rank holds the whole tensor.
    """

    mcore: str
    hf: tuple[str, ...]
    transform: str = COPY
    tp_dim: int | None = None

    def expand(self, i: int) -> "Rule":
        return Rule(self.mcore.format(i=i), tuple(h.format(i=i) for h in self.hf), self.transform, self.tp_dim)


def expand_rules(global_rules: list[Rule], block_rules: list[Rule], num_layers: int) -> list[Rule]:
    """The table of a whole model: global tensors, then every block's in order (blocks 0..L-1)."""
    return list(global_rules) + [r.expand(i) for i in range(num_layers) for r in block_rules]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[H*D, ...] x3 -> [H*3*D, ...] with rows grouped per head as (q_h, k_h, v_h).

    This is Megatron's fused-QKV layout: a contiguous split of dim 0 over TP ranks gives each rank
    whole heads, which is what lets the same global tensor serve every TP size.
    """
    parts = [t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(fused: torch.Tensor, heads: int, share_storage: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: three contiguous tensors, each its own (safetensors refuses tensors
    that share memory), or with ``share_storage`` three views of one [3, H*D, ...] tensor made by a
    single copy (one kernel instead of three, for a stream that copies them on at once)."""
    per_head = fused.reshape(heads, 3, -1, *fused.shape[1:])  # [H, 3, D, ...]
    if share_storage:
        return tuple(per_head.transpose(0, 1).reshape(3, -1, *fused.shape[1:]))
    return tuple(per_head[:, j].reshape(-1, *fused.shape[1:]).contiguous() for j in range(3))


def tp_shard(tensor: torch.Tensor, tp_dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of a global Megatron tensor held by ``tp_rank``."""
    if tp_dim is None or tp_size == 1:
        return tensor
    if tensor.shape[tp_dim] % tp_size:
        raise ValueError(f"dimension {tp_dim} of size {tensor.shape[tp_dim]} does not split over TP={tp_size}")
    return tensor.chunk(tp_size, dim=tp_dim)[tp_rank].contiguous()


def to_mcore(rule: Rule, hf_get: Callable[[str], torch.Tensor], heads: int) -> torch.Tensor:
    """The global (unsharded) Megatron tensor of ``rule`` from HF tensors."""
    tensors = [hf_get(name) for name in rule.hf]
    if rule.transform == QKV:
        return fuse_qkv(*tensors, heads=heads)
    return tensors[0]


def to_hf(rule: Rule, mcore_tensor: torch.Tensor, heads: int, share_storage: bool = False
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs of ``rule`` from its global Megatron tensor (``split_qkv`` says what
    ``share_storage`` does to q / k / v)."""
    if rule.transform == QKV:
        yield from zip(rule.hf, split_qkv(mcore_tensor, heads, share_storage))
    else:
        yield rule.hf[0], mcore_tensor


def hf_shapes(rules: list[Rule], mcore_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes implied by global Megatron shapes (QKV rows divide by 3)."""
    out = {}
    for rule in rules:
        shape = tuple(mcore_shapes[rule.mcore])
        if rule.transform == QKV:
            shape = (shape[0] // 3, *shape[1:])
        out.update({h: shape for h in rule.hf})
    return out


def hf_views(rule: Rule, local: torch.Tensor, heads: int, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """Per HF name of ``rule``: (the view of this rank's Megatron tensor ``local`` that HF tensor fills,
    a function giving the matching view of the whole HF tensor).  Copying every pair equals
    ``local.copy_(tp_shard(to_mcore(rule, hf, heads), rule.tp_dim, tp_rank, tp_size))`` without building
    the fused or global tensor: q / k / v land in strided views of the per-head interleaved QKV.  A fused
    QKV also has an entry under the tuple of its three names, for q, k, v stacked as [3, H*D, ...]
    (e.g. side by side in a buffer): one copy instead of three."""
    n = tp_size if rule.tp_dim is not None else 1
    rank = tp_rank if n > 1 else 0
    if rule.transform == QKV:
        if rule.tp_dim not in (None, 0) or heads % n:
            raise ValueError(f"{rule.mcore}: a fused QKV splits over TP along whole heads (dim 0); got tp_dim "
                             f"{rule.tp_dim}, {heads} heads, TP={n}")
        local_heads = heads // n
        fused_N3D = local.view(local_heads, 3, -1, *local.shape[1:])  # [N local heads, q/k/v, D, ...]
        lo = rank * local_heads

        def part(t: torch.Tensor) -> torch.Tensor:  # [H*D, ...] -> [N, D, ...], this rank's heads
            return t.view(heads, -1, *t.shape[1:])[lo:lo + local_heads]

        def stacked(t: torch.Tensor) -> torch.Tensor:  # [3, H*D, ...] -> [3, N, D, ...]
            return t.view(3, heads, -1, *t.shape[2:])[:, lo:lo + local_heads]

        out = {name: (fused_N3D[:, j], part) for j, name in enumerate(rule.hf)}
        out[rule.hf] = (fused_N3D.transpose(0, 1), stacked)
        return out
    if n == 1:
        return {rule.hf[0]: (local, lambda t: t)}
    return {rule.hf[0]: (local, lambda t: t.chunk(n, dim=rule.tp_dim)[rank])}
