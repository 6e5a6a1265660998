"""The byte stream of one sender's sync: where every tensor sits, how the stream is cut into buckets,
and the copies in and out of the bucket buffers.

Every tensor starts at a 64-byte aligned offset, so a view of any dtype starts aligned.  The stream is
cut into buckets of ``bucket_bytes``; a tensor that straddles a bucket boundary (or is larger than a
bucket) is chunked.  Bucket k always lands in slot k % 2 of the two reused bucket buffers, so the typed
view of every tensor that lies inside one bucket is computed once per plan and buffer pair
(``StreamPlan.views``) and reused by every sync: per tensor, nothing is left to do in Python but hand
the view to one fused copy (``fused_copy``) per bucket.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from megatron_omni.sync.exporter import TensorMeta

ALIGN = 64  # byte alignment of every tensor in the stream


@dataclass(frozen=True)
class Entry:
    meta: TensorMeta
    offset: int  # byte offset in the stream


def layout(plan: Sequence[TensorMeta]) -> tuple[tuple[Entry, ...], int]:
    entries, pos = [], 0
    for meta in plan:
        entries.append(Entry(meta, pos))
        pos += -(-meta.nbytes // ALIGN) * ALIGN
    return tuple(entries), pos


def plan_digest(entries: Sequence[Entry], mode: str, bucket_bytes: int) -> str:
    """xxh3-128 of the pickled entries, the mode and the bucket size: equal digests, equal streams."""
    import xxhash

    h = xxhash.xxh3_128(pickle.dumps(tuple(entries), protocol=4))
    h.update(f"|{mode}|{bucket_bytes}".encode())
    return h.hexdigest()


@dataclass
class StreamPlan:
    """One sender's stream: what the metadata message describes, plus views computed on first use."""

    mode: str
    bucket_bytes: int
    entries: tuple[Entry, ...]
    total: int
    digest: str
    _views: tuple = field(default=(), repr=False)  # (buffer pointers, per-entry views)

    @classmethod
    def build(cls, plan: Sequence[TensorMeta], mode: str, bucket_bytes: int) -> "StreamPlan":
        if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise ValueError(f"weight sync bucket of {bucket_bytes} bytes: expected a positive multiple of {ALIGN}")
        entries, total = layout(plan)
        return cls(mode, bucket_bytes, entries, total, plan_digest(entries, mode, bucket_bytes))

    def message(self) -> dict:
        """The metadata message that describes this plan in full (sent when the digest is new)."""
        return {"mode": self.mode, "bucket_bytes": self.bucket_bytes, "entries": self.entries, "total": self.total,
                "digest": self.digest}

    @classmethod
    def from_message(cls, msg: dict) -> "StreamPlan":
        return cls(msg["mode"], msg["bucket_bytes"], tuple(msg["entries"]), msg["total"], msg["digest"])

    @property
    def n_buckets(self) -> int:
        return -(-self.total // self.bucket_bytes)

    def bucket_size(self, k: int) -> int:
        return min(self.bucket_bytes, self.total - k * self.bucket_bytes)

    def _place(self, e: Entry) -> tuple[int, int, bool]:
        """(bucket k of the entry's first byte, its start in that bucket, whether it lies inside it)."""
        k, start = divmod(e.offset, self.bucket_bytes)
        return k, start, start + e.meta.nbytes <= self.bucket_bytes

    def views(self, bufs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per entry: its typed view in slot k % 2 of ``bufs`` when it lies inside bucket k, else None
        (it straddles buckets).  Computed once per buffer pair."""
        key = tuple(b.data_ptr() for b in bufs)
        if not self._views or self._views[0] != key:
            out = []
            for e in self.entries:
                k, start, inside = self._place(e)
                out.append(bufs[k % 2][start:start + e.meta.nbytes].view(e.meta.dtype).view(e.meta.shape)
                           if inside else None)
            self._views = (key, out)
        return self._views[1]

    def inside(self) -> dict[int, list[int]]:
        """Bucket k -> the indices of the entries that lie inside it (not straddling)."""
        out: dict[int, list[int]] = {}
        for i, e in enumerate(self.entries):
            k, _, inside = self._place(e)
            if inside:
                out.setdefault(k, []).append(i)
        return out

    def pieces(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """Bucket k -> (entry index, start, end in the bucket, start in the entry) of every piece of a
        straddling entry that bucket k holds, in stream order."""
        out: dict[int, list[tuple[int, int, int, int]]] = {}
        bb = self.bucket_bytes
        for i, e in enumerate(self.entries):
            first, _, inside = self._place(e)
            if inside:
                continue
            start, end = e.offset, e.offset + e.meta.nbytes
            for k in range(first, -(-end // bb)):
                a, b = max(start, k * bb), min(end, (k + 1) * bb)
                out.setdefault(k, []).append((i, a - k * bb, b - k * bb, a - start))
        return out


def copy_groups(dst: list[torch.Tensor], src: list[torch.Tensor]) -> list[tuple[list, list]]:
    """The pairs (dst[i], src[i]) grouped by devices, dtypes and layout, so that each group can take
    ``torch._foreach_copy_``'s fused path (one multi-tensor kernel on CUDA needs one device, one dtype
    and dense tensors of equal strides); a group it cannot fuse (strided views) is looped in C++."""
    if len(dst) != len(src):
        raise ValueError(f"copy_groups: {len(dst)} destinations for {len(src)} sources")
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dst, src):
        g = groups.setdefault((d.device, d.dtype, s.device, s.dtype, d.is_contiguous() and s.is_contiguous()),
                              ([], []))
        g[0].append(d)
        g[1].append(s)
    return list(groups.values())


def run_copies(groups: list[tuple[list, list]]) -> None:
    for d, s in groups:
        # asynchronous except into host memory, which the caller may read (or send) right away
        torch._foreach_copy_(d, s, non_blocking=d[0].device.type != "cpu")


def fused_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i in as few launches as torch allows (``copy_groups``)."""
    run_copies(copy_groups(dst, src))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class BucketWriter:
    """Sender side of the double-buffered stream.  A tensor inside bucket k is queued and the queue is
    copied with one ``fused_copy`` right before bucket k is sent; a tensor crossing a bucket boundary is
    copied in chunks at once.  Queued tensors must stay valid until then (``HFExporter.tensors`` says
    they do).  Bucket k + 1 is packed while bucket k is in flight."""

    def __init__(self, channel, src: int, plan: StreamPlan):
        self.channel, self.src, self.plan = channel, src, plan
        self.bufs = channel.bucket_buffers(plan.bucket_bytes)
        self.views = plan.views(self.bufs)
        self.k, self.dst, self.srcs = 0, [], []
        self.non_blocking = self.bufs[0].device.type != "cpu"  # host memory may be sent right away

    def add(self, i: int, t: torch.Tensor) -> None:
        entry, view = self.plan.entries[i], self.views[i]
        if view is not None:
            self._reach(entry.offset)
            self.dst.append(view)
            self.srcs.append(t)
            return
        bb, data, pos = self.plan.bucket_bytes, as_bytes(t), entry.offset
        while data.numel():
            self._reach(pos)
            start = pos - self.k * bb
            n = min(data.numel(), bb - start)
            self.bufs[self.k % 2][start:start + n].copy_(data[:n], non_blocking=self.non_blocking)
            data, pos = data[n:], pos + n

    def _reach(self, pos: int) -> None:
        """Send every bucket before the one holding byte ``pos``."""
        while pos >= (self.k + 1) * self.plan.bucket_bytes:
            self._send()

    def _send(self) -> None:
        fused_copy(self.dst, self.srcs)
        self.dst, self.srcs = [], []
        self.channel.send_bucket(self.k % 2, self.plan.bucket_size(self.k), self.src)
        self.k += 1
        self.channel.wait_slot(self.k % 2)  # the slot's previous bucket is delivered: it may be refilled

    def close(self) -> None:
        while self.k < self.plan.n_buckets:
            self._send()
        self.channel.wait_slot(0)
        self.channel.wait_slot(1)


def buckets_in(channel, src: int, plan: StreamPlan) -> Iterator[torch.Tensor]:
    """Bucket k as a uint8 view, valid until the next one is asked for; receive of k + 1 is posted first."""
    n, bufs = plan.n_buckets, channel.bucket_buffers(plan.bucket_bytes)
    if n:
        channel.recv_bucket(0, plan.bucket_size(0), src)
    for k in range(n):
        channel.wait_slot(k % 2)
        if k + 1 < n:
            channel.recv_bucket((k + 1) % 2, plan.bucket_size(k + 1), src)
        yield bufs[k % 2][:plan.bucket_size(k)]
    channel.end_stream()


def unpack(plan: StreamPlan, views: list, buckets: Iterator[tuple[int, torch.Tensor]]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) out of ``buckets`` ((k, uint8 view) in order): a tensor inside one bucket is its
    precomputed view, a straddling one is assembled in its own buffer.  A pair is valid until the next
    is asked for."""
    bb, entries, i, partial = plan.bucket_bytes, plan.entries, 0, None
    for k, buf in buckets:
        lo, hi = k * bb, k * bb + buf.numel()
        while i < len(entries):
            e = entries[i]
            start, end = e.offset, e.offset + e.meta.nbytes
            if start >= hi:
                break
            if views[i] is not None:
                yield e.meta.name, views[i]
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
