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
import time
import traceback
from multiprocessing import connection
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
    conn.send(("ok", None))
    channel = SharedMemoryChannel(shm_conn, buffers, rank=1, timeout_s=spec.timeout_s) \
        if spec.placement == "colocated" else None  # a sync group is joined at the first sync
    _serve(engine, channel, spec, index, conn)


def _join(engine, spec: ChannelSpec, index: int) -> GroupChannel:
    """The engine's end of the sync group.  Joined when the first sync starts, when every sender is
    joining too: a group set up at spawn would keep the engine from serving (and time out) until then."""
    device = torch.device("cpu") if spec.device == "cpu" else next(engine.model.parameters()).device  # its own
    if device.type == "meta":  # a model held only as shapes (a benchmark's sink) still receives on its GPU:
        device = torch.device(spec.device.split(":")[0], 0)  # NCCL cannot move meta tensors (that hung 2 H200s)
    return GroupChannel(spec.host, spec.port, spec.n_senders + index, spec.world_size, spec.backend, device,
                        spec.timeout_s)


def _serve(engine, channel, spec: ChannelSpec, index: int, conn) -> None:
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
                channel = channel or _join(engine, spec, index)
                result = _receive(engine, channel, spec.n_senders)
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


class EngineDied(SyncError):
    """An engine process exited (crashed, killed) while the trainer waited for its answer."""


class RemoteEngines:
    """Trainer-side handle of engine processes; ``generate`` splits requests evenly over them.  With
    ``n_senders`` > 1 (pipeline stages) the other stages' senders join through ``StageSender(address)``.
    After a failed sync (``SyncError``: an engine died, the group broke) ``restart()`` starts them again."""

    def __init__(self, procs, conns, spec: ChannelSpec, timeout_s: float, spawn_kwargs: dict):
        self.procs, self.conns, self.spec, self.timeout_s = procs, conns, spec, timeout_s
        self.spawn_kwargs = spawn_kwargs  # what restart() spawns again
        self.channel = None
        self.address = (spec.host, spec.port)
        self.broken: str | None = None  # why the engines must be restarted before further use

    @classmethod
    def spawn(cls, factory: Callable, n: int = 1, placement: str = "process", backend: str = "gloo",
              timeout_s: float = 60.0, bucket_bytes: int = 1 << 30, device: str = "cpu",
              start_timeout_s: float = 300.0, n_senders: int = 1,
              child_env: dict[str, str] | None = None) -> "RemoteEngines":
        """``child_env`` is set in the engine processes before anything in them starts CUDA, e.g.
        ``{"CUDA_VISIBLE_DEVICES": "1"}`` to put an engine on another GPU than the trainer's."""
        kwargs = dict(factory=factory, n=n, placement=placement, backend=backend, timeout_s=timeout_s,
                      bucket_bytes=bucket_bytes, device=device, start_timeout_s=start_timeout_s,
                      n_senders=n_senders, child_env=child_env)
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
        engines = cls(procs, conns, spec, timeout_s, kwargs)
        try:
            for i in range(n):
                engines._reply(i, start_timeout_s, "start")
        except SyncError:
            engines.close()
            raise
        if placement == "colocated":
            engines.channel = SharedMemoryChannel(shm[0], buffers, rank=0, timeout_s=timeout_s)
        return engines

    def restart(self) -> None:
        """Stop the engine processes (whatever state they are in) and spawn them again on a new sync group
        (``address`` changes: other stages' ``StageSender.reconnect`` it).  The new engines hold their
        factory's weights: the next sync must send the whole model."""
        self.close()
        fresh = type(self).spawn(**self.spawn_kwargs)
        self.__dict__.update(fresh.__dict__)

    def _send_cmd(self, i: int, cmd: tuple) -> None:
        if self.broken is not None:
            raise SyncError(f"the engine processes need restart() after a failed sync ({self.broken})")
        try:
            self.conns[i].send(cmd)
        except (OSError, ValueError) as e:  # BrokenPipeError: the process is gone
            self.broken = f"engine process {i} is gone (exit code {self.procs[i].exitcode})"
            raise EngineDied(f"{self.broken}; cannot send {cmd[0]!r}: {e!r}") from None

    def _reply(self, i: int, timeout_s: float, what: str):
        conn = self.conns[i]
        try:
            if not conn.poll(timeout_s):
                raise SyncError(f"engine process {i} did not answer {what!r} within {timeout_s} s")
            status, value = conn.recv()
        except (EOFError, OSError):
            raise EngineDied(f"engine process {i} died during {what!r} (exit code {self.procs[i].exitcode})") from None
        if status != "ok":
            raise SyncError(f"engine process {i} failed {what!r}: {value}")
        return value

    def _all(self, cmd: tuple, timeout_s: float | None = None) -> list:
        for i in range(len(self.conns)):
            self._send_cmd(i, cmd)
        return [self._reply(i, timeout_s or self.timeout_s, cmd[0]) for i in range(len(self.conns))]

    def generate(self, requests: Sequence) -> list:
        n = len(self.conns)
        chunks = [list(requests[i * len(requests) // n:(i + 1) * len(requests) // n]) for i in range(n)]
        for i, chunk in enumerate(chunks):
            self._send_cmd(i, ("generate", chunk))
        out = []
        for i in range(n):
            out += self._reply(i, 24 * 3600, "generate")
        return out

    def sync(self, exporter: HFExporter, bucket_bytes: int = 1 << 30, checksum: bool = False) -> dict:
        """Push the exporter's tensors to every engine: as the only sender, or as stage 0's while the other
        stages' ``StageSender.sync`` run at the same time.  The first sync sets up the sync group."""
        error, stats, told = None, {}, []
        for i in range(len(self.conns)):
            try:
                self._send_cmd(i, ("sync",))
                told.append(i)
            except SyncError as e:
                error = error or e
        if error is None:
            error, stats = self._stream(exporter, bucket_bytes, checksum)
        else:
            _drain(exporter.tensors())
        receipts: dict[int, dict] = {}
        error = self._sync_replies(told, error, receipts)
        if error is not None:
            raise error
        return {**stats, "engines": [receipts[i] for i in sorted(receipts)]}  # each engine's own timings

    def _sync_replies(self, told: list[int], error: SyncError | None, receipts: dict) -> SyncError | None:
        """Every told engine's answer to "sync" (into ``receipts``: its own timings), or the first error.
        Once an engine has died the others are not waited for (they may wait in the broken group until its
        timeout): the engines are marked broken, and only ``restart()`` makes them usable again."""
        pending, deadline = set(told), time.monotonic() + self.timeout_s + 30
        while pending:
            ready = connection.wait([self.conns[i] for i in pending], max(0.0, deadline - time.monotonic()))
            if not ready:  # hung: a late answer would be taken for the next command's
                self.broken = f"engine process(es) {sorted(pending)} gave no answer to 'sync' in {self.timeout_s + 30} s"
                return error or SyncError(self.broken)
            for i in [i for i in pending if self.conns[i] in ready]:
                pending.discard(i)
                try:
                    receipts[i] = self._reply(i, 0, "sync")
                except SyncError as e:
                    error = error or e
                    if isinstance(e, EngineDied):
                        self.broken = str(e)
            if self.broken is not None:
                return error
        return error

    def _stream(self, exporter: HFExporter, bucket_bytes: int, checksum: bool):
        if self.channel is None:
            s = self.spec
            try:
                self.channel = GroupChannel(s.host, s.port, 0, s.world_size, s.backend, s.device, s.timeout_s)
            except RuntimeError as e:  # an engine never joined (gloo / NCCL rendezvous timeout)
                _drain(exporter.tensors())
                return SyncError(f"weight sync: setting up the sync group failed: {str(e).splitlines()[0]}"), {}
            self.channel.peer_failed = self._peer_failed
        error, stats = _send(self.channel, 0, self.spec.n_senders, exporter, bucket_bytes, checksum)
        if error is not None and getattr(self.channel, "aborted", False):  # the group is gone: only restart() makes a new one
            self.broken = str(error)
        return error, stats

    def _peer_failed(self) -> str:
        """'' while every engine is alive and silent; a sync's collectives see this while they wait (an
        engine answers 'sync' only after its last collective, so an earlier answer means it gave up)."""
        for i, (p, c) in enumerate(zip(self.procs, self.conns)):
            if not p.is_alive():
                return f"engine process {i} exited with code {p.exitcode}"
            try:
                if c.poll():
                    return f"engine process {i} answered before the sync's collectives ended"
            except (OSError, EOFError):
                return f"engine process {i}'s pipe is closed"
        return ""

    def held(self, mode: str = "full") -> list[dict]:
        return self._all(("held", mode))

    def sleep(self) -> None:
        self._all(("sleep",))

    def wake(self) -> None:
        self._all(("wake",))

    def close(self) -> None:
        """Ask every engine process to exit; broken engines (one died in a sync) are killed at once, since
        the others may be waiting in the broken sync group."""
        for i, c in enumerate(self.conns):
            try:
                if self.broken is None:
                    c.send(("close",))
                    self._reply(i, 10, "close")
            except (SyncError, OSError, EOFError):
                pass
        for p in self.procs:
            p.join(timeout=0 if self.broken else 10)
            if p.is_alive():
                p.kill()
                p.join()
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def _send(channel, src: int, n_senders: int, exporter: HFExporter, bucket_bytes: int, checksum: bool):
    """(error or None, stats); on failure the exporter still runs to its end, so the other TP ranks'
    gathers stay in step."""
    tensors = exporter.tensors()
    try:
        return None, send_weights(channel, src, n_senders, exporter.plan(), tensors, bucket_bytes, exporter.mode,
                                  checksum)
    except Exception as e:
        _drain(tensors)
        if isinstance(e, SyncError):
            return e, {}
        return SyncError(f"weight sync failed on the trainer: {type(e).__name__}: {e}"), {}


def _drain(tensors) -> None:
    """Run the exporter to its end without sending: the other TP ranks of the stage are in its gathers."""
    for _ in tensors:
        pass


class StageSender:
    """The sender of pipeline stage ``stage`` > 0: streams its own blocks to the engines that stage 0's
    ``RemoteEngines`` drives (``address`` is that object's ``address``, passed over the trainer's group)."""

    def __init__(self, address: tuple[str, int], stage: int, n_senders: int, n_engines: int, backend: str = "gloo",
                 device: str = "cpu", timeout_s: float = 60.0):
        self.args = (address[0], address[1], stage, n_senders + n_engines, backend, device, timeout_s)
        self.stage, self.n_senders, self.channel = stage, n_senders, None

    def sync(self, exporter: HFExporter, bucket_bytes: int = 1 << 30, checksum: bool = False) -> dict:
        if self.channel is None:
            try:
                self.channel = GroupChannel(*self.args)
            except RuntimeError as e:  # the group's rendezvous timed out
                _drain(exporter.tensors())
                raise SyncError(f"weight sync: stage {self.stage} could not join the sync group at "
                                f"{self.args[:2]}: {str(e).splitlines()[0]}") from None
        error, stats = _send(self.channel, self.stage, self.n_senders, exporter, bucket_bytes, checksum)
        if error is not None:
            raise error
        return stats

    def reconnect(self, address: tuple[str, int]) -> None:
        """Join the sync group of restarted engines (``RemoteEngines.restart``) at the next sync."""
        self.close()
        self.args = (address[0], address[1], *self.args[2:])

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class Rank0Engine:
    """The trainer ranks' view of engines that only trainer rank 0 drives: rank 0 generates and syncs,
    every rank of ``group`` receives the trajectories and the sync's outcome (broadcasts of Python
    objects), so that after a failed sync all of them restart and sync again together."""

    def __init__(self, engines: RemoteEngines | None, group=None):
        self.engines, self.group = engines, group

    def _from_rank0(self, value):
        import torch.distributed as dist

        box = [value]
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        return box[0]

    def generate(self, requests: Sequence) -> list:
        return self._from_rank0(self.engines.generate(requests) if self.engines is not None else None)

    def park(self) -> None:
        """Nothing to free here: the engine processes' memory is not the trainer's."""

    def sync(self, exporter: HFExporter, bucket_bytes: int = 1 << 30, checksum: bool = False) -> dict:
        """Rank 0 sends; the other ranks run their exporters (gathers over TP).  A ``SyncError`` on rank 0
        is raised on every rank."""
        stats, error = {}, None
        if self.engines is None:
            _drain(exporter.tensors())
        else:
            try:
                stats = self.engines.sync(exporter, bucket_bytes, checksum)
            except SyncError as e:
                error = str(e)
        error = self._from_rank0(error)
        if error is not None:
            raise SyncError(error)
        return stats

    def restart(self) -> None:
        if self.engines is not None:
            self.engines.restart()

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
