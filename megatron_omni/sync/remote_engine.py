"""Rollout engines in processes of their own, and the trainer-side handle that drives them.

``RemoteEngines.spawn(factory, ...)`` starts ``n`` engine processes; each builds its engine with
``factory(index)`` (a module-level function returning an ``EmbeddedEngine``) and serves commands
from its pipe, one at a time: generate, sync, sleep, wake, close.
Protocol of a sync, per engine: pause (the "sync" command occupies the serving loop, so requests that
arrive meanwhile wait) -> receive and load (all-or-nothing) -> report -> resume serving.

Placement: "process" puts the engines behind a dedicated process group (``GroupChannel``: gloo,
NCCL or HCCL) with the trainer's sender as rank 0; "colocated" gives one engine the shared-memory
channel (``SharedMemoryChannel``), whose two buffers are allocated once here.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.multiprocessing as mp

from megatron_omni.parallel.state import TORCHRUN_ENV, free_port
from megatron_omni.sync import engine_side
from megatron_omni.sync.broadcaster import GroupChannel, SyncError, receive_weights, send_weights
from megatron_omni.sync.colocated import SharedMemoryChannel, shared_buffers
from megatron_omni.sync.exporter import HFExporter


@dataclass(frozen=True)
class ChannelSpec:
    """How an engine process reaches the trainer (picklable; sent at spawn)."""
    placement: str  # "process" or "colocated"
    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 2
    timeout_s: float = 60.0
    device: str = "cpu"
    n_senders: int = 1  # sync ranks 0 .. n_senders - 1 send (one per pipeline stage); engines follow


def _engine_main(index: int, factory: Callable, spec: ChannelSpec, conn, shm_conn, buffers, env: dict) -> None:
    for name in TORCHRUN_ENV:  # the engine is not a rank of the trainer's torchrun world
        os.environ.pop(name, None)
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        engine = factory(index)
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", None))  # the trainer joins the channel once every engine is built
    if spec.placement == "colocated":
        channel = SharedMemoryChannel(shm_conn, buffers, rank=1, timeout_s=spec.timeout_s)
    else:  # on an accelerator the engine receives on its own device
        device = spec.device if spec.device == "cpu" else next(engine.model.parameters()).device
        channel = GroupChannel(spec.host, spec.port, spec.n_senders + index, spec.world_size, spec.backend, device,
                               spec.timeout_s)
    _serve(engine, channel, conn, spec.n_senders)


def _serve(engine, channel, conn, n_senders: int) -> None:
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return  # the trainer is gone
        try:
            if cmd == "close":
                conn.send(("ok", None))
                return
            if cmd == "generate":
                result = engine.generate(args[0])
            elif cmd == "sync":
                result = _receive(engine, channel, n_senders)
            elif cmd in ("sleep", "wake"):
                result = getattr(engine, cmd)()
            elif cmd == "held":  # the engine's tensors under the names of a sync mode (tests, checks)
                result = {k: v.detach().clone() for k, v in engine_side.held(engine, args[0]).items()}
            else:
                raise ValueError(f"unknown engine command {cmd!r}")
            conn.send(("ok", result))
        except BaseException as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


def _receive(engine, channel, n_senders: int) -> dict:
    mode_box = {}

    def check(mode, plan):
        mode_box["mode"] = mode
        return engine_side.check_plan(engine, mode, plan)

    return receive_weights(channel, n_senders, check, lambda pairs: engine_side.load(engine, mode_box["mode"], pairs),
                           lambda mode: engine_side.held(engine, mode))


class RemoteEngines:
    """Trainer-side handle of engine processes; ``generate`` splits requests evenly over them.  With
    ``n_senders`` > 1 (pipeline stages) the other stages' senders join through ``StageSender(address)``."""

    def __init__(self, procs, conns, spec: ChannelSpec, timeout_s: float):
        self.procs, self.conns, self.spec, self.timeout_s = procs, conns, spec, timeout_s
        self.channel = None
        self.address = (spec.host, spec.port)

    @classmethod
    def spawn(cls, factory: Callable, n: int = 1, placement: str = "process", backend: str = "gloo",
              timeout_s: float = 60.0, bucket_bytes: int = 1 << 30, device: str = "cpu",
              start_timeout_s: float = 300.0, n_senders: int = 1,
              child_env: dict[str, str] | None = None) -> "RemoteEngines":
        """``child_env`` is set in the engine processes before anything in them starts CUDA, e.g.
        ``{"CUDA_VISIBLE_DEVICES": "1"}`` to put an engine on another GPU than the trainer's."""
        if placement not in ("process", "colocated"):
            raise ValueError(f"engine placement {placement!r} is not one of ['process', 'colocated']")
        if placement == "colocated" and (n, n_senders) != (1, 1):
            raise ValueError(f"colocated placement serves one engine process from one sender; got n={n}, "
                             f"n_senders={n_senders}")
        ctx = mp.get_context("spawn")
        spec = ChannelSpec(placement, backend, "127.0.0.1", free_port(), n_senders + n, timeout_s, device, n_senders)
        env = {"OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}), **(child_env or {})}
        buffers = shared_buffers(bucket_bytes, device) if placement == "colocated" else None
        shm = ctx.Pipe() if placement == "colocated" else (None, None)
        procs, conns = [], []
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_engine_main, args=(i, factory, spec, child, shm[1], buffers, env), daemon=True)
                p.start()
                procs.append(p)
                conns.append(parent)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        engines = cls(procs, conns, spec, timeout_s)
        try:
            for i in range(n):
                engines._reply(i, start_timeout_s, "start")
        except SyncError:
            engines.close()
            raise
        if placement == "colocated":
            engines.channel = SharedMemoryChannel(shm[0], buffers, rank=0, timeout_s=timeout_s)
        elif n_senders == 1:  # else at the first sync, when the other stages' senders join too
            engines.channel = GroupChannel(spec.host, spec.port, 0, spec.world_size, backend, device, timeout_s)
        return engines

    def _reply(self, i: int, timeout_s: float, what: str):
        conn = self.conns[i]
        if not conn.poll(timeout_s):
            raise SyncError(f"engine process {i} did not answer {what!r} within {timeout_s} s")
        try:
            status, value = conn.recv()
        except EOFError:
            raise SyncError(f"engine process {i} died during {what!r} (exit code {self.procs[i].exitcode})") from None
        if status != "ok":
            raise SyncError(f"engine process {i} failed {what!r}: {value}")
        return value

    def _all(self, cmd: tuple, timeout_s: float | None = None) -> list:
        for c in self.conns:
            c.send(cmd)
        return [self._reply(i, timeout_s or self.timeout_s, cmd[0]) for i in range(len(self.conns))]

    def generate(self, requests: Sequence) -> list:
        n = len(self.conns)
        chunks = [list(requests[i * len(requests) // n:(i + 1) * len(requests) // n]) for i in range(n)]
        for c, chunk in zip(self.conns, chunks):
            c.send(("generate", chunk))
        out = []
        for i in range(n):
            out += self._reply(i, 24 * 3600, "generate")
        return out

    def sync(self, exporter: HFExporter, bucket_bytes: int = 1 << 30, checksum: bool = False) -> dict:
        """Push the exporter's tensors to every engine: as the only sender, or as stage 0's while the other
        stages' ``StageSender.sync`` run at the same time."""
        for c in self.conns:
            c.send(("sync",))
        if self.channel is None:
            s = self.spec
            self.channel = GroupChannel(s.host, s.port, 0, s.world_size, s.backend, s.device, s.timeout_s)
        error, stats = _send(self.channel, 0, self.spec.n_senders, exporter, bucket_bytes, checksum)
        for i in range(len(self.conns)):
            try:
                self._reply(i, self.timeout_s + 30, "sync")
            except SyncError as e:
                error = error or e
        if error is not None:
            raise error
        return stats

    def held(self, mode: str = "full") -> list[dict]:
        return self._all(("held", mode))

    def sleep(self) -> None:
        self._all(("sleep",))

    def wake(self) -> None:
        self._all(("wake",))

    def close(self) -> None:
        for i, c in enumerate(self.conns):
            try:
                c.send(("close",))
                self._reply(i, 10, "close")
            except (SyncError, OSError, EOFError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if self.channel is not None:
            self.channel.close()


def _send(channel, src: int, n_senders: int, exporter: HFExporter, bucket_bytes: int, checksum: bool):
    """(error or None, stats); on failure the exporter still runs to its end, so the other TP ranks'
    gathers stay in step."""
    tensors = exporter.tensors()
    try:
        return None, send_weights(channel, src, n_senders, exporter.plan(), tensors, bucket_bytes, exporter.mode,
                                  checksum)
    except Exception as e:
        for _ in tensors:
            pass
        if isinstance(e, SyncError):
            return e, {}
        return SyncError(f"weight sync failed on the trainer: {type(e).__name__}: {e}"), {}


class StageSender:
    """The sender of pipeline stage ``stage`` > 0: streams its own blocks to the engines that stage 0's
    ``RemoteEngines`` drives (``address`` is that object's ``address``, passed over the trainer's group)."""

    def __init__(self, address: tuple[str, int], stage: int, n_senders: int, n_engines: int, backend: str = "gloo",
                 device: str = "cpu", timeout_s: float = 60.0):
        self.args = (address[0], address[1], stage, n_senders + n_engines, backend, device, timeout_s)
        self.stage, self.n_senders, self.channel = stage, n_senders, None

    def sync(self, exporter: HFExporter, bucket_bytes: int = 1 << 30, checksum: bool = False) -> dict:
        if self.channel is None:
            self.channel = GroupChannel(*self.args)
        error, stats = _send(self.channel, self.stage, self.n_senders, exporter, bucket_bytes, checksum)
        if error is not None:
            raise error
        return stats

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


class Rank0Engine:
    """The trainer ranks' view of engines that only trainer rank 0 drives: rank 0 generates, every rank
    of ``group`` receives the trajectories (a broadcast of Python objects)."""

    def __init__(self, engines: RemoteEngines | None, group=None):
        self.engines, self.group = engines, group

    def generate(self, requests: Sequence) -> list:
        import torch.distributed as dist

        box = [self.engines.generate(requests) if self.engines is not None else None]
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
