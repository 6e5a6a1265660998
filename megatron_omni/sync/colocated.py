"""Colocated channel: the engine runs in another process on the same device.  Two bucket buffers in
shared memory (CUDA IPC on GPU, POSIX shared memory on CPU) are created once by the trainer, handed to
the engine process once, and reused for every bucket of every sync: no handle per tensor.

Control messages go over a ``multiprocessing`` pipe: ("obj", x) metadata, ("bucket", slot, n) when
a slot is filled, ("free", slot) when the engine has consumed it, ("status", s).  Every wait polls
with the configured timeout and fails with ``SyncError`` when the peer is gone.
Same interface as ``broadcaster.GroupChannel``; the trainer is sync rank 0, the engine rank 1.
"""
from __future__ import annotations

import torch

from megatron_omni.sync.broadcaster import PlanCache, SyncError


def shared_buffers(capacity: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The two bucket buffers, allocated once; pass them to the engine process (spawn args or a pipe)."""
    bufs = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(2)]
    return [b.share_memory_() if b.device.type == "cpu" else b for b in bufs]


class SharedMemoryChannel:
    def __init__(self, conn, buffers: list[torch.Tensor], rank: int, timeout_s: float = 60.0):
        self.conn, self.buffers, self.rank, self.timeout_s = conn, buffers, rank, timeout_s
        self.world_size = 2
        self._busy = [False, False]  # sender: slot handed to the engine, not yet freed
        self._used = [False, False]  # receiver: slot holds a bucket it has consumed
        self._expect: list[int | None] = [None, None]
        self.plans = PlanCache()

    # ---- pipe with a timeout ------------------------------------------------------------------------
    def _recv(self, what: str):
        try:
            if not self.conn.poll(self.timeout_s):
                raise SyncError(f"colocated weight sync: no {what} from the peer within {self.timeout_s} s")
            return self.conn.recv()
        except (EOFError, OSError, ConnectionError) as e:
            raise SyncError(f"colocated weight sync: the peer process is gone while waiting for {what} ({e!r})") from None

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ConnectionError) as e:
            raise SyncError(f"colocated weight sync: the peer process is gone ({e!r})") from None

    def _sync_device(self) -> None:
        if self.buffers[0].device.type == "cuda":
            torch.cuda.current_stream(self.buffers[0].device).synchronize()

    # ---- channel interface ----------------------------------------------------------------------------
    def send_obj(self, obj) -> None:
        self._send(("obj", obj))

    def recv_obj(self, src: int, obj=None):
        if src == self.rank:
            self.send_obj(obj)
            return obj
        kind, value = self._recv("metadata")
        if kind != "obj":
            raise SyncError(f"colocated weight sync: expected metadata, got {kind!r}")
        return value

    def bucket_buffers(self, bucket_bytes: int) -> list[torch.Tensor]:
        if bucket_bytes > self.buffers[0].numel():
            raise SyncError(f"bucket of {bucket_bytes} bytes exceeds the shared buffers' {self.buffers[0].numel()}")
        return [b[:bucket_bytes] for b in self.buffers]

    def send_bucket(self, slot: int, nbytes: int, src: int) -> None:
        if self.rank == src:
            self.wait_slot(slot)
            self._sync_device()  # the packing copies are done before the engine reads
            self._send(("bucket", slot, nbytes))
            self._busy[slot] = True
        else:  # post a receive into ``slot``: what it held has been consumed
            self._release(slot)
            self._expect[slot] = nbytes

    recv_bucket = send_bucket

    def _release(self, slot: int) -> None:
        if self._used[slot]:
            self._sync_device()  # the engine's copies out of the slot are done
            self._send(("free", slot))
            self._used[slot] = False

    def wait_slot(self, slot: int) -> None:
        if self.rank == 0:  # sender: wait until the engine has freed the slot
            while self._busy[slot]:
                kind, freed = self._recv("bucket release")
                if kind != "free":
                    raise SyncError(f"colocated weight sync: expected a bucket release, got {kind!r}")
                self._busy[freed] = False
        elif self._expect[slot] is not None:
            msg = self._recv("a weight bucket")
            if msg[0] != "bucket" or msg[1] != slot:
                raise SyncError(f"colocated weight sync: expected bucket in slot {slot}, got {msg[:2]}")
            self._expect[slot], self._used[slot] = None, True

    def end_stream(self) -> None:
        if self.rank != 0:
            self._release(0)
            self._release(1)

    def exchange_status(self, message: str) -> list[str]:
        if self.rank == 0:
            while True:  # releases of the last buckets may still be queued before the status
                msg = self._recv("status")
                if msg[0] == "free":
                    self._busy[msg[1]] = False
                    continue
                break
            self._send(("status", message))
            return [message, msg[1]]
        self._send(("status", message))
        _, theirs = self._recv("status")
        return [theirs, message]

    def close(self) -> None:
        self.conn.close()
