"""Where the GPU time of one call goes: kernels grouped by kind (matmul, attention, fused Triton, element-wise,
communication, ...), the GPU's busy fraction of the wall time, and the heaviest kernels.  Shared by the
benchmarks' ``--profile`` flags; prints a short table.  Also the benches' CUDA-event timer (``median_ms``).
"""
from __future__ import annotations

import re
import statistics
import time
import warnings
from collections import Counter

import torch

# first match wins; names are CUDA kernel names as the profiler reports them
KINDS = (
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|matmul|sm90_|sm100_"),
    ("optimizer", r"adam|multi_tensor"),
    ("triton (fused)", r"^triton_"),
    ("reduction / norm", r"reduce|norm|softmax"),
    ("copy / cat", r"copy|cat|memcpy|memset|fill|index"),
    ("element-wise", r"elementwise|vectorized|unrolled"),
)


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after ``warmup`` calls (CUDA events; the wall clock
    without CUDA, for the benches' CPU smoke runs)."""
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_shape_args(doc: str, argv=None, switches: dict[str, str] | None = None):
    """The row-kernel benches' options (the rollout batch, its text tokens, the repeats; ``switches``: a bench's own
    flags, name -> help), checked, on a CUDA device with Triton (a GPU Triton kernel's bench has no CPU mode): the
    parsed namespace."""
    import argparse
    import importlib.util

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--batch", type=int, default=16, help="rollout batch (one CFG branch)")
    p.add_argument("--text-tokens", type=int, default=109)
    p.add_argument("--repeats", type=int, default=20)
    for name, text in (switches or {}).items():
        p.add_argument(f"--{name}", action="store_true", help=text)
    args = p.parse_args(argv)
    if min(args.batch, args.text_tokens, args.repeats) < 1:
        p.error(f"--batch {args.batch}, --text-tokens {args.text_tokens}, --repeats {args.repeats}: expected >= 1")
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        p.error("no CUDA device with Triton: this bench times a GPU Triton kernel")
    return args


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def profile_kernels(fn, title: str, top: int = 12, host: bool = False, shapes: bool = False,
                    trace: str | None = None) -> dict[str, float]:
    """Run ``fn`` once under torch.profiler (CUDA synchronised around it); print milliseconds per kernel
    kind and the ``top`` heaviest kernels (with ``host``, also the host-side ops that took the most CPU
    time: where a step that leaves the GPU idle spends it; with ``shapes``, the matmul ops by device time with
    their input shapes: which product a slow GEMM kernel is); ``trace``: also write the Chrome trace there (a
    ``.json.gz`` path is gzipped); return {kind: ms} plus 'wall' and 'kernels'."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host or shapes else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    if trace:
        prof.export_chrome_trace(trace)
        print(f"  Chrome trace: {trace}")
    per_kernel: dict[str, tuple[float, int]] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.device_time_total <= 0:
            continue
        ms, n = per_kernel.get(evt.name, (0.0, 0))
        per_kernel[evt.name] = (ms + evt.device_time_total / 1e3, n + 1)
    by_kind: dict[str, float] = {}
    for name, (ms, _) in per_kernel.items():
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + ms
    total = sum(by_kind.values())
    print(f"--- {title}: wall {wall_ms:.1f} ms, kernels {total:.1f} ms (GPU busy {total / wall_ms:.0%} if on one "
          f"stream) ---")
    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<18} {ms:>9.1f} ms {ms / total:>6.1%}")
    print("  heaviest kernels:")
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:>9.1f} ms {n:>6}x  [{kind(name)}] {name[:110]}")
    if host:
        print("  host: ops by self CPU time")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        for e in rows:
            print(f"  {e.self_cpu_time_total / 1e3:>9.1f} ms {e.count:>6}x  {e.key[:110]}")
    if host:
        idle_gaps(prof.events(), top)
    if shapes:
        print("  matmul ops by device time, with input shapes:")
        ops = [e for e in prof.key_averages(group_by_input_shape=True) if re.search(r"mm|linear|matmul|addmm", e.key)]
        for e in sorted(ops, key=lambda e: -e.device_time_total)[:top]:
            print(f"  {e.device_time_total / 1e3:>9.1f} ms {e.count:>6}x  {e.key} {e.input_shapes}")
    return {**by_kind, "wall": wall_ms, "kernels": total}


def _intervals(events, device: bool) -> list[tuple[float, float, object]]:
    want = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    # (sorted by times only: events with equal ranges, e.g. an op and its single child, do not compare)
    return sorted(((e.time_range.start, e.time_range.end, e) for e in events
                   if e.device_type == want and e.time_range.end > e.time_range.start), key=lambda t: t[:2])


def _chain(evt, levels: int = 3) -> str:
    """An op's name with its host-side parents' (outermost first, ``levels`` deep at most)."""
    names = []
    while evt is not None and len(names) < levels:
        names.append(evt.name[:50])
        evt = evt.cpu_parent
    return " < ".join(names)


def idle_gaps(events, top: int = 12, min_us: float = 10.0) -> float:
    """Print where the GPU sat idle: every gap of at least ``min_us`` between kernels (all streams merged), charged
    to the host op that was running when the gap ended, i.e. the op that launched the kernel the GPU was waiting
    for (with its parents).  Returns the idle milliseconds."""
    import bisect

    kernels = _intervals(events, device=True)
    if not kernels:
        return 0.0
    gaps, reach = [], kernels[0][1]
    for start, end, _ in kernels[1:]:
        if start - reach >= min_us:
            gaps.append((reach, start))
        reach = max(reach, end)
    host = _intervals(events, device=False)
    starts = [h[0] for h in host]
    charged: Counter = Counter()
    for g0, g1 in gaps:
        i, deepest = bisect.bisect_right(starts, g1) - 1, None
        for j in range(i, max(i - 5000, -1), -1):  # the latest-starting host op still running at g1: the innermost
            if host[j][1] >= g1:
                deepest = host[j][2]
                break
        charged[_chain(deepest) if deepest is not None else "(no host op)"] += (g1 - g0) / 1e3
    idle = sum(charged.values())
    print(f"  GPU idle in gaps >= {min_us:.0f} us: {idle:.1f} ms over {len(gaps)} gaps; by the host op ending them:")
    for place, ms in charged.most_common(top):
        print(f"  {ms:>9.1f} ms  {place[:150]}")
    return idle


def sync_points(fn, top: int = 10) -> Counter:
    """Run ``fn`` with CUDA's sync debug mode on; print the Python lines where the host waited for the
    device (each such wait drains the GPU's queue), most frequent first."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = Counter(f"{w.filename.split('site-packages/')[-1]}:{w.lineno}" for w in caught
                    if "synchroniz" in str(w.message).lower())
    print(f"  host waits for the device: {sum(where.values())}")
    for place, n in where.most_common(top):
        print(f"  {n:>6}x  {place}")
    return where


def graph_breaks() -> str:
    """torch.compile's graph breaks so far, by reason (a fused region ends at each)."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    if not breaks:
        return "graph breaks: none"
    return "graph breaks: " + "; ".join(f"{n}x {reason[:160]}" for reason, n in breaks.items())
