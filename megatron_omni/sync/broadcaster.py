"""Bucketed weight sync, trainer -> rollout engines.  Protocol of one sync, in one line:
pause engines -> metadata (names / shapes / dtypes / offsets, once) -> every side validates -> byte
buckets -> engines load -> optional checksums -> status -> resume.

The tensors of a sync form one byte stream (each tensor at a 64-byte aligned offset).  The stream is
cut into buckets of ``bucket_bytes``; a tensor that straddles a bucket boundary (or is larger than a
bucket) is simply chunked.  The sender packs bucket k + 1 into its second buffer while bucket k is
still in flight (double buffering); a receiver posts the receive of bucket k + 1 before unpacking k.

Any side's error (unknown name, wrong shape, load failure, checksum mismatch) is exchanged in the
status rounds, so every side raises the same ``SyncError`` naming the tensor.  Names and shapes are
checked before a single byte moves, and ``engine.load_weights`` itself is all-or-nothing, so a failed
sync leaves the engine's previous weights in place.  A dead peer fails the others within the channel's
timeout (gloo / NCCL / HCCL group timeout, or the colocated pipe's poll timeout).

Channels (``GroupChannel`` here: a dedicated process group; ``colocated.SharedMemoryChannel``) provide
``recv_obj`` (a broadcast of a Python object from one rank), ``bucket_buffers``, ``send_bucket`` /
``recv_bucket`` / ``wait_slot`` (post and complete a bucket transfer), ``end_stream`` and
``exchange_status`` (every rank's error message, '' = ok).
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_omni.sync.exporter import TensorMeta

ALIGN = 64  # byte alignment of every tensor in the stream: a view of any dtype starts aligned
STATUS_BYTES = 1024  # per-rank status message in the status round


class SyncError(RuntimeError):
    """A weight sync was refused or failed; the message names the tensor or the peer."""


@dataclass(frozen=True)
class Entry:
    meta: TensorMeta
    offset: int  # byte offset in the stream


def layout(plan: Sequence[TensorMeta]) -> tuple[list[Entry], int]:
    entries, pos = [], 0
    for meta in plan:
        entries.append(Entry(meta, pos))
        pos += -(-meta.nbytes // ALIGN) * ALIGN
    return entries, pos


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-64 of the tensor's bytes (as stored: dtype, C order)."""
    import xxhash

    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return xxhash.xxh3_64_hexdigest(data)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ---- the dedicated process group -------------------------------------------------------------------

class GroupChannel:
    """A process group of its own (NCCL on GPU, HCCL on NPU, gloo on CPU) between the trainer's sender
    rank(s) and the engines, built from a TCPStore: it needs no default group, so the trainer's
    torchrun world and the engine processes stay independent.  Ranks 0 .. n_senders - 1 send."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 device: torch.device | str = "cpu", timeout_s: float = 60.0, prefix: str = "weight_sync"):
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.pg = _make_group(backend, dist.PrefixStore(prefix + "/", self.store), rank, world_size, timeout)
        self._buffers: list[torch.Tensor] = []
        self._work: list = [None, None]

    def _bcast(self, tensor: torch.Tensor, src: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def send_obj(self, obj) -> None:
        self.recv_obj(self.rank, obj)

    def recv_obj(self, src: int, obj=None):
        blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else None
        size = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64, device=self.device)
        _wait(self._bcast(size, src), f"metadata size from sync rank {src}")
        buf = blob.to(self.device) if blob is not None else torch.empty(int(size), dtype=torch.uint8, device=self.device)
        _wait(self._bcast(buf, src), f"metadata from sync rank {src}")
        return pickle.loads(buf.cpu().numpy().tobytes())

    def bucket_buffers(self, bucket_bytes: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() != bucket_bytes:
            self._buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._buffers

    def send_bucket(self, slot: int, nbytes: int, src: int) -> None:
        """Start the broadcast of ``bucket_buffers()[slot][:nbytes]`` (sender or receiver side)."""
        self.wait_slot(slot)
        self._work[slot] = self._bcast(self._buffers[slot][:nbytes], src)

    recv_bucket = send_bucket

    def wait_slot(self, slot: int) -> None:
        work, self._work[slot] = self._work[slot], None
        if work is not None:
            _wait(work, "a weight bucket")

    def end_stream(self) -> None:
        """Nothing to release: a broadcast buffer is free once its work completed."""

    def exchange_status(self, message: str) -> list[str]:
        """Every rank's status ('' = ok), in sync-rank order."""
        mine = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        raw = message.encode()[:STATUS_BYTES]
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
        out = [torch.empty(STATUS_BYTES, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        _wait(self.pg.allgather([out], [mine.to(self.device)]), "the status round")
        return [bytes(o.cpu().numpy()).rstrip(b"\0").decode(errors="replace") for o in out]

    def close(self) -> None:
        self._buffers, self._work = [], [None, None]
        if hasattr(self.pg, "shutdown"):
            self.pg.shutdown()


def _make_group(backend: str, store, rank: int, size: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers ProcessGroupHCCL)

        opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, size, opts)
    raise ValueError(f"sync backend {backend!r} is not one of ['gloo', 'nccl', 'hccl']")


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise SyncError(f"weight sync: waiting for {what} failed ({str(e).splitlines()[0][:300]}); a peer "
                        f"died or timed out") from None


# ---- sender ---------------------------------------------------------------------------------------------

def _raise_if_failed(statuses: list[str], stage: str) -> None:
    bad = [(r, s) for r, s in enumerate(statuses) if s]
    if bad:
        raise SyncError(f"weight sync refused at {stage}: " + "; ".join(f"sync rank {r}: {s}" for r, s in bad))


def send_weights(channel, src: int, n_senders: int, plan: Sequence[TensorMeta],
                 tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, mode: str,
                 checksum: bool = False) -> dict:
    """The sender side of one sync for sender ``src`` of ``n_senders`` (one per pipeline stage).
    Every sender calls it at the same time; the streams go one after the other, in sender order."""
    t0 = time.perf_counter()
    entries, total = layout(plan)
    metas = [channel.recv_obj(s, {"mode": mode, "bucket_bytes": bucket_bytes, "total": total,
                                  "entries": entries} if s == src else None) for s in range(n_senders)]
    _raise_if_failed(channel.exchange_status(""), "metadata")
    t1 = time.perf_counter()
    sums = {}
    for s in range(n_senders):
        if s == src:
            sums = _stream_out(channel, src, entries, total, tensors, bucket_bytes, checksum)
        else:
            _relay_other(channel, s, metas[s])
    t2 = time.perf_counter()
    for s in range(n_senders):
        channel.recv_obj(s, sums if s == src else None)
    _raise_if_failed(channel.exchange_status(""), "load / checksum")
    t3 = time.perf_counter()
    # where a sync's time goes, seen from the sender: plan + metadata round, export + pack + send of the
    # buckets (overlapped with the receiver unpacking), and the receiver finishing its load (+ checksums)
    return {"bytes": total, "tensors": len(entries), "buckets": -(-total // bucket_bytes),
            "seconds": {"metadata": t1 - t0, "stream": t2 - t1, "finish": t3 - t2}}


def _relay_other(channel, src: int, meta: dict) -> None:
    """A sender takes part in another sender's broadcasts (a group collective) without using them."""
    for _ in _buckets_in(channel, src, meta["total"], meta["bucket_bytes"]):
        pass


def _stream_out(channel, src, entries, total, tensors, bucket_bytes, checksum) -> dict[str, str]:
    bufs = channel.bucket_buffers(bucket_bytes)
    sums, k, it = {}, 0, iter(tensors)
    for entry in entries:
        name, t = next(it, (None, None))
        meta = entry.meta
        if name != meta.name or tuple(t.shape) != meta.shape or t.dtype != meta.dtype:
            got = "nothing" if name is None else f"{name!r} {tuple(t.shape)} {t.dtype}"
            raise SyncError(f"exporter yielded {got}; its plan said {meta.name!r} {meta.shape} {meta.dtype}")
        if checksum:
            sums[name] = tensor_checksum(t)
        data, pos = _bytes(t), entry.offset
        while data.numel():
            while pos >= (k + 1) * bucket_bytes:  # bucket k is full: send it, switch buffers
                channel.send_bucket(k % 2, bucket_bytes, src)
                k += 1
                channel.wait_slot(k % 2)
            start = pos - k * bucket_bytes
            n = min(data.numel(), bucket_bytes - start)
            bufs[k % 2][start:start + n].copy_(data[:n], non_blocking=True)
            data, pos = data[n:], pos + n
    n_buckets = -(-total // bucket_bytes)
    while k < n_buckets:
        channel.send_bucket(k % 2, min(bucket_bytes, total - k * bucket_bytes), src)
        k += 1
    channel.wait_slot(0)
    channel.wait_slot(1)
    return sums


# ---- receiver -------------------------------------------------------------------------------------------

def _buckets_in(channel, src: int, total: int, bucket_bytes: int) -> Iterator[torch.Tensor]:
    """Bucket k as a uint8 view, valid until the next one is asked for; receive of k + 1 is posted first."""
    n = -(-total // bucket_bytes)
    bufs = channel.bucket_buffers(bucket_bytes)
    size = lambda k: min(bucket_bytes, total - k * bucket_bytes)  # noqa: E731
    if n:
        channel.recv_bucket(0, size(0), src)
    for k in range(n):
        channel.wait_slot(k % 2)
        if k + 1 < n:
            channel.recv_bucket((k + 1) % 2, size(k + 1), src)
        yield bufs[k % 2][:size(k)]
    channel.end_stream()


def _unpack(channel, src: int, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) out of the buckets; a tensor inside one bucket is a view, a straddling one is
    assembled in its own buffer.  Consumers copy a view before asking for the next pair."""
    bucket_bytes, entries = meta["bucket_bytes"], meta["entries"]
    i, partial = 0, None
    for k, buf in enumerate(_buckets_in(channel, src, meta["total"], bucket_bytes)):
        lo, hi = k * bucket_bytes, k * bucket_bytes + buf.numel()
        while i < len(entries):
            e = entries[i]
            start, end = e.offset, e.offset + e.meta.nbytes
            if start >= hi:
                break
            if start >= lo and end <= hi and partial is None:
                yield e.meta.name, buf[start - lo:end - lo].view(e.meta.dtype).view(e.meta.shape)
                i += 1
                continue
            if partial is None:
                partial = torch.empty(e.meta.nbytes, dtype=torch.uint8, device=buf.device)
            a, b = max(start, lo), min(end, hi)
            partial[a - start:b - start].copy_(buf[a - lo:b - lo])
            if end > hi:
                break
            yield e.meta.name, partial.view(e.meta.dtype).view(e.meta.shape)
            partial, i = None, i + 1


def receive_weights(channel, n_senders: int, check: Callable[[str, list[TensorMeta]], str],
                    load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                    held: Callable[[str], dict[str, torch.Tensor]] | None = None) -> dict:
    """The engine side of one sync.  ``check(mode, plan)`` returns '' or an error naming the tensor;
    ``load(pairs)`` is ``engine.load_weights`` (all-or-nothing); ``held(mode)`` gives the engine's
    tensors after the load under the sent names, for the checksum."""
    metas = [channel.recv_obj(s) for s in range(n_senders)]
    mode = metas[0]["mode"]
    plan = [e.meta for m in metas for e in m["entries"]]
    _raise_if_failed(channel.exchange_status(check(mode, plan)), "metadata")
    pairs = (p for s in range(n_senders) for p in _unpack(channel, s, metas[s]))
    error = ""
    try:
        load(pairs)
    except SyncError:  # the channel itself failed (dead peer, timeout): nothing left to keep in step
        raise
    except Exception as e:  # keep the protocol in step: drain the rest, report in the status round
        error = f"load_weights failed: {e}"
        for _ in pairs:
            pass
    sums = {}
    for s in range(n_senders):
        sums.update(channel.recv_obj(s) or {})
    if not error and sums and held is not None:
        mine = held(mode)
        wrong = [n for n, h in sums.items() if n not in mine or tensor_checksum(mine[n]) != h]
        if wrong:
            error = f"checksum mismatch on {len(wrong)} tensor(s), e.g. {wrong[0]!r}"
    _raise_if_failed(channel.exchange_status(error), "load / checksum")
    return {"bytes": sum(m["total"] for m in metas), "tensors": len(plan), "checksums": len(sums)}
