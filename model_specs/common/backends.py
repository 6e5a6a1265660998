"""Which implementation of the tensor-parallel linear layers a spec is built from.

"local": megatron-core's own ``ColumnParallelLinear`` / ``RowParallelLinear`` (always available,
CPU included; the row one through ``megatron_omni.parallel.linears``, which stops its per-call warning).  "te": Transformer Engine's wrappers from megatron-core (fused kernels, FP8), only
when ``transformer_engine`` imports.  "auto" picks "te" when it is installed and a CUDA device is
present, else "local".  One spec builder per block takes the result; no copied TE variant.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "local", "te")


@dataclass(frozen=True)
class LinearBackend:
    name: str
    column: type
    row: type


def _te_linears() -> tuple[type, type] | None:
    # megatron-core's TE extension module imports without TE too (it puts mock stand-ins in place of
    # TE's classes), so ask for transformer_engine itself first.
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    return TEColumnParallelLinear, TERowParallelLinear


def linear_backend(name: str = "auto") -> LinearBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    te = _te_linears() if name in ("te", "auto") else None
    if name == "te" and te is None:
        raise ValueError("backend 'te' requested but transformer_engine is not installed "
                         "(pip install 'megatron-omni[te]'), or use backend 'local'")
    if te is not None and (name == "te" or torch.cuda.is_available()):
        return LinearBackend("te", *te)
    from megatron_omni.parallel.linears import ColumnParallelLinear, RowParallelLinear

    return LinearBackend("local", ColumnParallelLinear, RowParallelLinear)
