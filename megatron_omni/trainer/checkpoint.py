"""Training checkpoints: model + megatron-core optimizer + loop state, written atomically.

Layout: ``<root>/step_000010/`` (a megatron-core distributed checkpoint, plus ``run_config.yaml``: the resolved
run config that trained it, so that ``megatron-omni export`` / ``generate --checkpoint`` can rebuild the model) and
``<root>/latest`` (text: the newest complete step).  A checkpoint is written under ``.step_000010.partial`` and renamed only
when complete, and ``latest`` is replaced atomically after that, so a crash at any moment leaves the
previous checkpoint intact and resumable.

Resuming is bit-exact when every random draw of the loop is a function of (seed, step, index) — the
loop state saved here is then just the step and what the caller puts in ``extra``.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing

from checkpoints_convert.mcore_checkpoint import weights_sharded_state_dict
from megatron_omni.parallel.cpu_compat import apply_cpu_compat, cuda_factories_on_cpu


class Checkpointer:
    def __init__(self, root: str | os.PathLike, keep: int = 2, run_config: str | None = None):
        self.root, self.keep, self.run_config = Path(root), keep, run_config

    def latest_step(self) -> int | None:
        latest = self.root / "latest"
        if not latest.exists():
            return None
        step = int(latest.read_text().strip())
        if not (self.root / _name(step)).is_dir():
            raise FileNotFoundError(f"{latest} names step {step} but {self.root / _name(step)} is missing")
        return step

    def _state(self, model, optimizer, is_loading: bool, algorithm_state=None) -> dict[str, Any]:
        model_sd = _chunks_sharded_state_dict(model)
        state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}
        if algorithm_state is not None:  # e.g. an EMA of the policy (megatron_omni.algorithms.base)
            state["algorithm_state"] = algorithm_state.sharded_state_dict(model_sd)
        return state

    def save(self, step: int, model, optimizer, extra: dict[str, Any], algorithm_state=None) -> Path:
        apply_cpu_compat()
        final, partial = self.root / _name(step), self.root / f".{_name(step)}.partial"
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        state = self._state(model, optimizer, is_loading=False, algorithm_state=algorithm_state)
        state["loop"] = {"step": step, **extra}
        with cuda_factories_on_cpu():
            dist_checkpointing.save(state, str(partial))
        _barrier()
        if rank0:
            if self.run_config is not None:  # beside megatron's files (its save wants an empty folder)
                (partial / RUN_CONFIG).write_text(self.run_config)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            tmp = self.root / "latest.tmp"
            tmp.write_text(f"{step}\n")
            os.replace(tmp, self.root / "latest")
            self._prune(step)
        _barrier()
        return final

    def load(self, model, optimizer, step: int | None = None, algorithm_state=None) -> dict[str, Any]:
        """Load into the model, the optimizer and ``algorithm_state`` in place; returns the loop state saved with
        them."""
        apply_cpu_compat()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.root} to resume from")
        with cuda_factories_on_cpu():
            state = dist_checkpointing.load(self._state(model, optimizer, True, algorithm_state),
                                            str(self.root / _name(step)))
        chunks = _chunks(model)
        for v, chunk in enumerate(chunks):
            prefix = f"chunk{v}." if len(chunks) > 1 else ""
            chunk.load_state_dict({k[len(prefix):]: t for k, t in state["model"].items() if k.startswith(prefix)},
                                  strict=False)
        optimizer.load_state_dict(state["optimizer"])
        if algorithm_state is not None:
            algorithm_state.load(state["algorithm_state"])
        return state["loop"]

    def _prune(self, newest: int) -> None:
        steps = sorted(int(p.name.split("_")[1]) for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: max(0, len(steps) - self.keep)]:
            if old != newest:
                shutil.rmtree(self.root / _name(old), ignore_errors=True)


RUN_CONFIG = "run_config.yaml"


def _chunks(model) -> list:
    """A model, or the model chunks of one rank (interleaved PP: one per virtual stage), as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _chunks_sharded_state_dict(model) -> dict[str, Any]:
    """``weights_sharded_state_dict`` of a model, or of every chunk of an interleaved pipeline under
    ``chunk<v>.`` keys: a tensor an earlier chunk of this rank holds alike (the replicated timestep embedder) is
    marked a replica there, so that one rank writes it once."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return weights_sharded_state_dict(chunks[0])
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    merged, seen = {}, set()
    for v, chunk in enumerate(chunks):
        sd = weights_sharded_state_dict(chunk)
        for key, value in sd.items():
            if isinstance(value, ShardedTensor) and value.key in seen:
                replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
                value.replica_id = (pp * v + stage, *replica[1:])
            merged[f"chunk{v}.{key}"] = value
        seen |= {t.key for t in sd.values() if isinstance(t, ShardedTensor)}
    return merged


def _name(step: int) -> str:
    return f"step_{step:06d}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
