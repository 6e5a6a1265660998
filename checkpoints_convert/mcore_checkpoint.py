"""Megatron distributed checkpoints (megatron-core ``dist_checkpointing``, torch_dist format).

On disk a tensor is stored as its *global* tensor, whatever TP / PP wrote it; a loader asks for
the slices its own layout needs, so a checkpoint written at TP=2 loads at TP=1 and the reverse
(resharding on load).  Tensor keys are the model's parameter names (``blocks.3.img_mod.weight``),
and the common state holds ``{"megatron_omni": {family, arch, tp, pp, ...}}`` so the checkpoint
describes itself.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from checkpoints_convert.hf_folder import ConversionError
from megatron_omni.parallel.cpu_compat import apply_cpu_compat

META_KEY = "megatron_omni"


@contextmanager
def process_group_for_io() -> Iterator[None]:
    """dist_checkpointing needs torch.distributed; a plain one-process command gets a world of one."""
    apply_cpu_compat()  # the saver calls torch.cuda.current_device() (state_dict_saver.py)
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_global_tensors(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Save whole (unsharded) tensors from one process, e.g. the output of an HF conversion."""
    sharded: dict[str, Any] = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
    sharded[META_KEY] = meta
    with process_group_for_io():
        dist_checkpointing.save(sharded, str(out_dir))


def read_meta(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise ConversionError(f"{ckpt_dir} is not a Megatron distributed checkpoint (no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    if META_KEY not in common:
        raise ConversionError(f"{ckpt_dir} was not written by megatron-omni (no '{META_KEY}' entry in its "
                              f"common state); expected a checkpoint from `megatron-omni convert` or training")
    return common[META_KEY]


def load_global_tensors(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole, in one process (the TP=1 / PP=1 view)."""
    with process_group_for_io():
        metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
        request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(sh.global_shape, dtype=sh.dtype), replica_id=0)
                   for k, sh in metadata.items()}
        loaded = dist_checkpointing.load(request, str(ckpt_dir))
    return {k: loaded[k] for k in request}


def weights_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's sharded state dict without ``_extra_state`` entries: those carry layer state that is
    not a weight (Transformer Engine's FP8 scaling history; None for local layers), which a converted
    checkpoint does not have and a weight checkpoint need not keep.  Under pipeline parallelism a tensor that
    several stages hold alike (a DiT's timestep embedder, replicated on every stage) is marked a replica on every
    stage but the first that holds it, so that exactly one rank writes it."""
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    _mark_stage_replicas(sharded)
    return sharded


def _mark_stage_replicas(sharded: dict[str, Any]) -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    group, stage = parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_pipeline_model_parallel_rank()
    keys = {v.key for v in sharded.values() if isinstance(v, ShardedTensor)}
    held: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, keys, group=group)
    earlier = set().union(*held[:stage])
    for value in sharded.values():
        if isinstance(value, ShardedTensor) and value.key in earlier:
            replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (stage, *replica[1:]) if len(replica) > 1 else (stage, *replica)


def save_model(model: torch.nn.Module, out_dir: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Save a (possibly TP-sharded) MegatronModule's weights collectively from all its ranks."""
    sharded = weights_sharded_state_dict(model)
    sharded[META_KEY] = meta
    apply_cpu_compat()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(out_dir))


def load_model(model: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Load into a MegatronModule at its own TP layout, reading only this rank's slices."""
    apply_cpu_compat()
    state = dist_checkpointing.load(weights_sharded_state_dict(model), str(ckpt_dir))
    state.pop(META_KEY, None)
    model.load_state_dict(state, strict=False)
    missing = {k for k in model.state_dict() if not k.endswith("_extra_state")} - set(state)
    if missing:
        raise ConversionError(f"checkpoint {ckpt_dir} lacks tensors the model needs: {sorted(missing)[:5]}")
