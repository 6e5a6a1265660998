"""Pipeline-parallel helpers for DiT models: which blocks a (virtual) stage holds, and results that
only the last stage computes.

Chunk order is megatron-core's: with pp ranks and vpp virtual stages per rank the model is cut into
pp*vpp consecutive chunks and chunk c = vpp_rank * pp + pp_rank runs on pipeline rank pp_rank, so the
activations visit ranks 0, 1, ..., pp-1, 0, 1, ... (interleaved 1F1B).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist


def stage_layers(num_layers: int, pp: int, pp_rank: int, vpp: int | None = None, vpp_rank: int = 0,
                 layout: Sequence[int] | None = None) -> range:
    """Global block indices of one (virtual) pipeline stage: an even split, or ``layout`` = the number of
    blocks of each of the pp*vpp chunks in pipeline order (e.g. [5, 7] at pp=2: fewer on the stage that
    also embeds)."""
    chunks = pp * (vpp or 1)
    if layout is None:
        if num_layers % chunks:
            raise ValueError(f"num_layers={num_layers} does not split evenly over pp*vpp = {pp}*{vpp or 1} = "
                             f"{chunks} pipeline chunks; expected a multiple of {chunks} or an explicit layout")
        layout = [num_layers // chunks] * chunks
    layout = list(layout)
    if len(layout) != chunks or sum(layout) != num_layers or min(layout) < 1:
        raise ValueError(f"pipeline layout {layout} must give each of the pp*vpp = {chunks} chunks >= 1 block "
                         f"and sum to num_layers={num_layers}")
    chunk = vpp_rank * pp + pp_rank
    start = sum(layout[:chunk])
    return range(start, start + layout[chunk])


def broadcast_from_last_stage(obj: Any, pp_group: dist.ProcessGroup) -> Any:
    """Give every pipeline rank what the last stage computed (e.g. the per-micro-batch log-probs that
    ``forward_only`` + ``collect_non_loss_data`` return only there).  Picklable objects, small."""
    if pp_group.size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, pp_group.size() - 1), group=pp_group)
    return box[0]
