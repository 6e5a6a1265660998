"""megatron-core's local tensor-parallel linears, with one fix the DiT hot path needs.

``RowParallelLinear``: megatron-core 0.19.2's ``RowParallelLinear.forward`` hands ``tp_group=None`` to its
matmul function, which then calls ``get_tensor_model_parallel_group_if_none(None)``: on rank 0 that issues a
``DeprecationWarning`` through ``warnings.warn`` on EVERY call (each row-parallel linear of each block, each
forward).  Besides the Python cost, torch.compile cannot trace ``warnings.warn`` and splits the block's graph
there (measured on an H200: 19 graph breaks compiling the rollout forward, 26 compiling training), so the
element-wise work on either side of each break stays unfused.  The row-parallel matmul needs no group
(no sequence parallelism, no input-gradient all-reduce: the output all-reduce happens after it), so passing
the layer's own group changes nothing but that.

Both also carry the rollout engine's weight copies (``model_specs.common.rollout_linear.RolloutLinear``: a LoRA
adapter merged in, float8 e4m3 products; without autograd only, once the engine switches them on).
"""
from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear as _MegatronColumnParallelLinear
from megatron.core.tensor_parallel import RowParallelLinear as _MegatronRowParallelLinear

from model_specs.common.rollout_linear import RolloutLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class ColumnParallelLinear(RolloutLinear, _MegatronColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` with the rollout's weight copies."""


class RowParallelLinear(RolloutLinear, _MegatronRowParallelLinear):
    """megatron-core's ``RowParallelLinear`` that passes its TP group down (see the module docstring), with the
    rollout's weight copies."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)
