"""Weight updaters: one object per transport, owning its exporters, its state and its retry.

Protocol in one line: ``push()`` leaves the engines holding the policy's current weights (plan once → buckets →
load → status) and returns the sync's stats; ``restarts`` counts the engine restarts that push needed.

What each sync sends is ``sync.mode`` (resolved by the run config): full weights, LoRA merged into them, or the
adapters only — then the trainer's base weights are sent whole first, once, while the engine lacks them (at the
start and after an engine restart).  Exporters are built at their first sync and reused: items, plan and the
source tensors are resolved once (the optimizer updates the parameters in place).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_omni.sync import engine_side
from megatron_omni.sync.broadcaster import SyncError
from megatron_omni.sync.exporter import HFExporter


class _Updater:
    def __init__(self, module, tp_group, engine, mode: str, bucket_bytes: int, checksum: bool, pp_group=None):
        self.module, self.tp_group, self.engine, self.pp_group = module, tp_group, engine, pp_group
        self.mode, self.bucket_bytes, self.checksum = mode, bucket_bytes, checksum
        self.exporters: dict[str, HFExporter] = {}
        self.engine_has_base = False  # "lora": the engine holds the trainer's base weights
        self.restarts = 0
        self.chunks = [module]  # this rank's model chunks (interleaved PP: one per virtual stage)
        self.later_exporters: dict[str, list[HFExporter]] = {}  # mode -> the exporters of chunks[1:]

    def _exporter(self, mode: str) -> HFExporter:
        if mode not in self.exporters:
            self.exporters[mode] = HFExporter(self.module, self.tp_group, self.pp_group, mode=mode,
                                              bucket_bytes=self.bucket_bytes)
        return self.exporters[mode]

    def _send(self, exporter: HFExporter) -> dict:
        raise NotImplementedError

    def _push_once(self) -> dict:
        if self.mode == "lora" and not self.engine_has_base:
            self._send(self._exporter("full"))
            self.engine_has_base = True
        return self._send(self._exporter(self.mode))

    def push(self) -> dict:
        self.restarts = 0
        return self._push_once()


class InProcessUpdater(_Updater):
    """export → the in-process engine's receiver (no transport).  An engine sharded as the policy (the same TP size
    and rank, e.g. both TP=1) takes this rank's own tensors as they are (``HFExporter.shards``: no TP gather, no
    HF names); a whole engine beside a TP-sharded policy takes the gathered HF tensors, every TP rank loading its
    own engine.  Under pipeline parallelism every rank's engine holds every block: each stage's tensors (its blocks
    and the global tensors it owns, ``HFExporter``) are broadcast over the pipeline group (whose ranks share a TP
    rank), stage by stage, and under interleaved PP chunk by chunk (an exporter per chunk)."""

    def _send(self, exporter: HFExporter) -> dict:
        own_shard = self.engine.tp_size == exporter.tp_size and self.engine.tp_rank == (
            dist.get_rank(self.tp_group) if exporter.tp_size > 1 else 0)
        if self.pp_group is None or dist.get_world_size(self.pp_group) == 1:
            if own_shard:
                return {"tensors": engine_side.load_shards(self.engine, exporter.mode, exporter.shards())}
            engine_side.load(self.engine, exporter.mode, exporter.tensors())
            return {"tensors": len(exporter.plan())}
        # one load of every stage's tensors: LoRA's commit takes the whole adapter set at once; a tensor every chunk
        # holds alike (the replicated timestep embedder) once
        pairs = {}
        for chunk_exporter in [exporter] + self._later_chunks(exporter.mode):
            for stage in range(dist.get_world_size(self.pp_group)):
                for name, t in stage_tensors(chunk_exporter, self.pp_group, stage, own_shard):
                    pairs.setdefault(name, t)
        if own_shard:
            return {"tensors": engine_side.load_shards(self.engine, exporter.mode, pairs.items())}
        engine_side.load(self.engine, exporter.mode, list(pairs.items()))
        return {"tensors": len(pairs)}

    def _later_chunks(self, mode: str) -> list[HFExporter]:
        """The exporters of this rank's chunks after the first (interleaved PP), built once per mode."""
        if mode not in self.later_exporters:
            self.later_exporters[mode] = [HFExporter(chunk, self.tp_group, self.pp_group, mode=mode,
                                                     bucket_bytes=self.bucket_bytes) for chunk in self.chunks[1:]]
        return self.later_exporters[mode]


def stage_tensors(exporter: HFExporter, pp_group, stage: int, shards: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Pipeline stage ``stage``'s exported (HF name, tensor) pairs on every rank of ``pp_group``: the stage
    gathers them (over its TP group) and broadcasts names, shapes and dtypes, then each tensor.  With ``shards``:
    its ranks' own shards under Megatron / peft names instead (``HFExporter.shards``: no gather)."""
    src = dist.get_global_rank(pp_group, stage)
    mine = dist.get_rank(pp_group) == stage
    pairs = exporter.shards() if shards else exporter.tensors()
    held = [(name, t.detach().clone()) for name, t in pairs] if mine else []
    box = [[(name, tuple(t.shape), t.dtype) for name, t in held]]
    dist.broadcast_object_list(box, src=src, group=pp_group)
    device = next(exporter.module.parameters()).device
    out = held if mine else [(name, torch.empty(shape, dtype=dtype, device=device)) for name, shape, dtype in box[0]]
    for _, t in out:
        dist.broadcast(t, src=src, group=pp_group)
    return out


class EngineProcessUpdater(_Updater):
    """plan once → buckets over the sync group (``process``) or shared memory (``colocated``) → engines load →
    status, driven by trainer rank 0 (``Rank0Engine``).  A failed sync (an engine died, the group broke) restarts
    the engine processes once and sends the whole model again; a second failure in a row is raised."""

    def _send(self, exporter: HFExporter) -> dict:
        return self.engine.sync(exporter, self.bucket_bytes, self.checksum)

    def push(self) -> dict:
        self.restarts = 0
        try:
            return self._push_once()
        except SyncError as e:
            print(f"warning: weight sync failed, restarting the rollout engine processes and syncing again: {e}")
            self.engine.restart()
            self.engine_has_base, self.restarts = False, self.restarts + 1
            return self._push_once()
