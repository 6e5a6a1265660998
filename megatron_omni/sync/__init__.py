"""Weight sync, trainer -> rollout engines (docs/design.md, decision 5).

    exporter = HFExporter(policy.module, state.tp_group, mode="merged", bucket_bytes=...)
    push_weights(engines, exporter, bucket_bytes, checksum)   # every TP rank calls it; rank 0 sends

``engines`` is a ``RemoteEngines`` (engine processes behind a dedicated process group, or colocated
behind shared memory), or an in-process engine with ``load_weights`` (no transport at all).  After a
sync that failed with ``SyncError`` (an engine died), ``engines.restart()`` starts the engine processes
again; they hold their factory's weights until the next sync of the whole model.
"""
from __future__ import annotations

from megatron_omni.sync import engine_side
from megatron_omni.sync.broadcaster import GroupChannel, SyncError, receive_weights, send_weights, tensor_checksum
from megatron_omni.sync.colocated import SharedMemoryChannel, shared_buffers
from megatron_omni.sync.exporter import MODES, HFExporter, TensorMeta
from megatron_omni.sync.remote_engine import Rank0Engine, RemoteEngines, StageSender


def push_weights(engines, exporter: HFExporter, bucket_bytes: int = 1 << 30, checksum: bool = False) -> dict:
    """One sync.  Ranks without engines (the other TP ranks of the stage) only take part in the
    exporter's gathers; an in-process engine is handed the exporter's stream directly (base weights to
    ``load_weights``, LoRA adapters into its own adapters: ``engine_side.load``)."""
    if engines is None:
        for _ in exporter.tensors():
            pass
        return {}
    if isinstance(engines, (RemoteEngines, StageSender, Rank0Engine)):
        return engines.sync(exporter, bucket_bytes, checksum)
    engine_side.load(engines, exporter.mode, exporter.tensors())
    return {"tensors": len(exporter.plan())}


__all__ = ["GroupChannel", "HFExporter", "MODES", "Rank0Engine", "RemoteEngines", "SharedMemoryChannel", "StageSender", "SyncError",
           "TensorMeta", "push_weights", "receive_weights", "send_weights", "shared_buffers", "tensor_checksum"]
