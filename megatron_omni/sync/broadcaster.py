"""Bucketed weight sync, trainer -> rollout engines.  Protocol of one sync, in one line:
pause engines -> metadata (the plan: names / shapes / dtypes / offsets; its digest alone when unchanged)
-> every side validates -> byte buckets -> engines load -> optional checksums -> status -> resume.

The tensors of a sync form one byte stream (``stream.StreamPlan``: each tensor at a 64-byte aligned
offset, cut into buckets of ``bucket_bytes``, a tensor crossing a boundary chunked).  The sender packs
bucket k + 1 into its second buffer while bucket k is still in flight (double buffering), one fused
copy per bucket; a receiver posts the receive of bucket k + 1 before unpacking k.

The plan is sent once: every rank of a channel keeps the last plan of each sender (``PlanCache``), and
a sender whose plan is unchanged since the last successful metadata round sends only its digest
(xxh3-128 of the entries, mode and bucket size).  A receiver that does not hold that digest refuses
the sync naming it, and the sender then forgets what it sent, so the next sync carries the plan in
full again; so does any changed plan.

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

import itertools
import pickle
import time
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_omni.sync.exporter import TensorMeta
from megatron_omni.sync.stream import BucketWriter, StreamPlan, buckets_in, unpack

STATUS_BYTES = 1024  # per-rank status message in the status round


class SyncError(RuntimeError):
    """A weight sync was refused or failed; the message names the tensor or the peer."""


class PlanCache:
    """Per channel, on every rank: the last plan of each sender.  ``known[s]`` is what every rank holds
    for sender s; the sender itself records its plan there only once a metadata round accepted it."""

    def __init__(self):
        self.known: dict[int, StreamPlan] = {}
        self._built: dict[int, tuple[list, StreamPlan]] = {}  # src -> (a copy of the plan, its StreamPlan)
        self._combined: tuple[tuple[str, ...], tuple[TensorMeta, ...]] = ((), ())

    def build(self, src: int, plan: Sequence[TensorMeta], mode: str, bucket_bytes: int) -> StreamPlan:
        """The sender's StreamPlan, rebuilt only when ``plan`` differs from last time.  The comparison is
        by value, but items that are the very same objects compare by identity at once, and
        ``HFExporter.plan`` hands out the same ``TensorMeta`` objects while nothing changed."""
        last = self._built.get(src)
        if last is not None and (last[1].mode, last[1].bucket_bytes) == (mode, bucket_bytes) and last[0] == plan:
            return last[1]
        built = StreamPlan.build(plan, mode, bucket_bytes)
        held = self.known.get(src)
        if held is not None and held.digest == built.digest:
            built = held  # the same stream: keep its computed views
        self._built[src] = (list(plan), built)
        return built

    def combined(self, plans: list[StreamPlan]) -> tuple[TensorMeta, ...]:
        """Every sender's tensors in order; the same tuple while the digests are unchanged (so a
        receiver's ``check`` may cache its verdict by identity)."""
        digests = tuple(p.digest for p in plans)
        if self._combined[0] != digests:
            self._combined = (digests, tuple(e.meta for p in plans for e in p.entries))
        return self._combined[1]


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-64 of the tensor's bytes (as stored: dtype, C order)."""
    import xxhash

    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return xxhash.xxh3_64_hexdigest(data)


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
        self.timeout_s = timeout_s
        # NCCL's own watchdog gets a minute more than our polled waits, so a dead peer is met by our abort
        # (a SyncError) rather than by the watchdog tearing the whole trainer process down
        group_timeout = timeout if backend == "gloo" else timedelta(seconds=timeout_s + 60)
        self.pg = _make_group(backend, dist.PrefixStore(prefix + "/", self.store), rank, world_size, group_timeout)
        self._buffers: list[torch.Tensor] = []
        self._work: list = [None, None]
        self.plans = PlanCache()
        # set by the trainer's engine handle: '' while every peer is alive, else what happened to one
        self.peer_failed: Callable[[], str] | None = None
        self.aborted = False

    def _bcast(self, tensor: torch.Tensor, src: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def send_obj(self, obj) -> None:
        self.recv_obj(self.rank, obj)

    def recv_obj(self, src: int, obj=None):
        blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else None
        size = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64, device=self.device)
        self._host_wait(self._bcast(size, src), f"metadata size from sync rank {src}")
        buf = blob.to(self.device) if blob is not None else torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self._host_wait(self._bcast(buf, src), f"metadata from sync rank {src}")
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
        if work is not None:  # on the host: stream work queued behind a broadcast that never ends would hang
            self._host_wait(work, "a weight bucket")  # the next synchronous CUDA call (a pageable copy, say)

    def end_stream(self) -> None:
        """Nothing to release: a broadcast buffer is free once its work completed."""

    def exchange_status(self, message: str) -> list[str]:
        """Every rank's status ('' = ok), in sync-rank order."""
        mine = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        raw = message.encode()[:STATUS_BYTES]
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
        out = [torch.empty(STATUS_BYTES, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        self._host_wait(self.pg.allgather([out], [mine.to(self.device)]), "the status round")
        return [bytes(o.cpu().numpy()).rstrip(b"\0").decode(errors="replace") for o in out]

    def _host_wait(self, work, what: str, grace_s: float = 2.0) -> None:
        """Wait for ``work`` on the host, polling: an NCCL / HCCL wait neither sees a peer that died nor one
        that gave up before joining the collective (its error went back over the command pipe), and would
        block until the watchdog kills the process.  Every metadata and status round goes through here,
        and bucket buffers too before they are reused.  A peer reported failed for ``grace_s`` while the
        work is still pending, or the timeout, aborts the group."""
        deadline, failed_since, pause = time.monotonic() + self.timeout_s, None, 1e-5
        while not work.is_completed():
            now = time.monotonic()
            failed = self.peer_failed() if self.peer_failed is not None else ""
            failed_since = (failed_since or now) if failed else None
            if now > deadline or (failed and now - failed_since > grace_s):
                self.abort()
                reason = failed or f"no answer within {self.timeout_s} s"
                raise SyncError(f"weight sync: waiting for {what} failed ({reason}); the group was aborted")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)  # metadata rounds finish in microseconds; a hang is polled at 1 kHz
        _wait(work, what)  # raises what the backend reports for a failed collective

    def abort(self) -> None:
        """Tear the group down without waiting for its pending collectives (after a failure)."""
        self._buffers, self._work, self.aborted = [], [None, None], True
        for name in ("abort", "shutdown"):
            if hasattr(self.pg, name):
                try:
                    getattr(self.pg, name)()
                except RuntimeError:
                    pass
                return

    def close(self) -> None:
        self._buffers, self._work = [], [None, None]
        if hasattr(self.pg, "shutdown") and not self.aborted:
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


# ---- metadata ---------------------------------------------------------------------------------------

def _raise_if_failed(statuses: list[str], stage: str) -> None:
    bad = [(r, s) for r, s in enumerate(statuses) if s]
    if bad:
        raise SyncError(f"weight sync refused at {stage}: " + "; ".join(f"sync rank {r}: {s}" for r, s in bad))


def _exchange_plans(channel, n_senders: int, src: int | None, mine: StreamPlan | None = None
                    ) -> tuple[list[StreamPlan | None], str]:
    """Every sender's plan on every rank (``src`` is this rank's sender index, None on engines): in full
    when new, else its digest alone.  Returns the plans and '' or an error naming an unknown digest."""
    cache, plans, error = channel.plans, [], ""
    for s in range(n_senders):
        out = None
        if s == src:
            held = cache.known.get(s)
            out = {"digest": mine.digest} if held is not None and held.digest == mine.digest else mine.message()
        msg = channel.recv_obj(s, out)
        if s == src:
            plans.append(mine)
            continue
        if "entries" in msg:
            cache.known[s] = StreamPlan.from_message(msg)
        held = cache.known.get(s)
        if held is None or held.digest != msg["digest"]:
            error = error or (f"sync rank {s} sent plan digest {msg['digest']}, which this rank does not hold (it "
                              f"holds {held.digest if held else 'none'}); the next sync carries the plan in full")
            held = None
        plans.append(held)
    return plans, error


# ---- sender ---------------------------------------------------------------------------------------------

def send_weights(channel, src: int, n_senders: int, plan: Sequence[TensorMeta],
                 tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, mode: str,
                 checksum: bool = False) -> dict:
    """The sender side of one sync for sender ``src`` of ``n_senders`` (one per pipeline stage).
    Every sender calls it at the same time; the streams go one after the other, in sender order."""
    t0 = time.perf_counter()
    mine = channel.plans.build(src, plan, mode, bucket_bytes)
    sent_in_full = channel.plans.known.get(src) is not mine
    plans, error = _exchange_plans(channel, n_senders, src, mine)
    try:
        _raise_if_failed(channel.exchange_status(error), "metadata")
    except SyncError:
        channel.plans.known.pop(src, None)  # whatever the receivers hold now, the next sync sends in full
        raise
    channel.plans.known[src] = mine
    t1 = time.perf_counter()
    sums = {}
    for s in range(n_senders):
        if s == src:
            sums = _stream_out(channel, src, mine, tensors, checksum)
        else:
            _relay_other(channel, s, plans[s])
    t2 = time.perf_counter()
    for s in range(n_senders):
        channel.recv_obj(s, sums if s == src else None)
    _raise_if_failed(channel.exchange_status(""), "load / checksum")
    t3 = time.perf_counter()
    # where a sync's time goes, seen from the sender: plan + metadata round; export + pack + send of the
    # buckets (overlapped with the receivers copying out of them); the receivers finishing their load
    # (+ checksums) and the status round
    return {"bytes": mine.total, "tensors": len(mine.entries), "buckets": mine.n_buckets,
            "plan": "full" if sent_in_full else "digest",
            "seconds": {"metadata": t1 - t0, "stream": t2 - t1, "finish": t3 - t2}}


def _relay_other(channel, src: int, plan: StreamPlan) -> None:
    """A sender takes part in another sender's broadcasts (a group collective) without using them."""
    for _ in buckets_in(channel, src, plan):
        pass


def _stream_out(channel, src: int, plan: StreamPlan, tensors, checksum: bool) -> dict[str, str]:
    writer = BucketWriter(channel, src, plan)
    sums, it = {}, iter(tensors)
    for i, entry in enumerate(plan.entries):
        name, t = next(it, (None, None))
        meta = entry.meta
        if name != meta.name or t.dtype != meta.dtype or t.shape != meta.shape:
            got = "nothing" if name is None else f"{name!r} {tuple(t.shape)} {t.dtype}"
            raise SyncError(f"exporter yielded {got}; its plan said {meta.name!r} {meta.shape} {meta.dtype}")
        if checksum:
            sums[name] = tensor_checksum(t)
        writer.add(i, t)
    writer.close()
    return sums


# ---- receiver -------------------------------------------------------------------------------------------

class Incoming:
    """The tensors of one sync as the receiver's ``load`` gets them, consumed once, one of two ways.
    Iterating gives (HF name, tensor) pairs in plan order, what ``engine.load_weights`` takes (a pair is
    valid until the next is asked for).  A loader with precomputed views takes ``buckets()`` instead:
    (sender index, k, uint8 view of that sender's bucket k) in order, each valid until the next; ``views(s)``
    are sender s's per-entry typed views into the bucket buffers (``StreamPlan.views``)."""

    def __init__(self, channel, plans: list[StreamPlan]):
        self.channel, self.plans = channel, plans
        self.mode, self.digests = plans[0].mode, tuple(p.digest for p in plans)
        self._buckets = self._all_buckets()

    def _all_buckets(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        for s, plan in enumerate(self.plans):
            for k, buf in enumerate(buckets_in(self.channel, s, plan)):
                yield s, k, buf

    def buckets(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        return self._buckets

    def views(self, s: int) -> list[torch.Tensor | None]:
        plan = self.plans[s]
        return plan.views(self.channel.bucket_buffers(plan.bucket_bytes))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for s, group in itertools.groupby(self._buckets, key=lambda b: b[0]):
            yield from unpack(self.plans[s], self.views(s), ((k, buf) for _, k, buf in group))

    def drain(self) -> None:
        """Receive what is left (the protocol stays in step after a failed load)."""
        for _ in self._buckets:
            pass


def receive_weights(channel, n_senders: int, check: Callable[[str, Sequence[TensorMeta]], str],
                    load: Callable[[Incoming], None],
                    held: Callable[[str], dict[str, torch.Tensor]] | None = None) -> dict:
    """The engine side of one sync.  ``check(mode, plan)`` returns '' or an error naming the tensor; it
    is called every sync, with the same plan tuple while the senders' digests are unchanged.
    ``load(incoming)`` is ``engine.load_weights`` (all-or-nothing) or a loader that uses ``Incoming``'s
    buckets; ``held(mode)`` gives the engine's tensors after the load under the sent names, for the checksum."""
    t0 = time.perf_counter()
    plans, error = _exchange_plans(channel, n_senders, None)
    mode = plans[0].mode if plans[0] is not None else ""
    if not error:
        error = check(mode, channel.plans.combined(plans))
    _raise_if_failed(channel.exchange_status(error), "metadata")
    t1 = time.perf_counter()
    incoming, error = Incoming(channel, plans), ""
    try:
        load(incoming)
    except SyncError:  # the channel itself failed (dead peer, timeout): nothing left to keep in step
        raise
    except Exception as e:  # keep the protocol in step: drain the rest, report in the status round
        error = f"load_weights failed: {e}"
    incoming.drain()
    t2 = time.perf_counter()
    sums = {}
    for s in range(n_senders):
        sums.update(channel.recv_obj(s) or {})
    if not error and sums and held is not None:
        mine = held(mode)
        wrong = [n for n, h in sums.items() if n not in mine or tensor_checksum(mine[n]) != h]
        if wrong:
            error = f"checksum mismatch on {len(wrong)} tensor(s), e.g. {wrong[0]!r}"
    _raise_if_failed(channel.exchange_status(error), "load / checksum")
    return {"bytes": sum(p.total for p in plans), "tensors": sum(len(p.entries) for p in plans),
            "checksums": len(sums),
            "seconds": {"metadata": t1 - t0, "load": t2 - t1, "finish": time.perf_counter() - t2}}
