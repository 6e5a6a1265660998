"""Why the GPU sat idle, from a torch.profiler Chrome trace (``flow_grpo_step.py --profile ... --trace DIR``).

For every gap of at least ``--min-us`` between kernels (all streams merged) it finds the launch of the kernel that
ended the gap (the runtime / driver call with the kernel's correlation id) and the thread that made it:

* launched late (the launch came after the gap began): the host was busy elsewhere.  The gap is charged to what
  the launching thread was doing when the GPU ran out of work -- its innermost host op at the gap's start, with
  two parents -- and, apart, to the op that made the launch;
* launched early (before the gap began): the kernel waited on the device (an event, another stream, a copy).

The sums come with their gap counts, heaviest first; also every synchronising runtime call (stream / device /
event synchronise, blocking copies) on any thread, with its total time.  One table per trace.

    python bench/idle_trace.py TRACE.json[.gz] [...] [--min-us 10] [--top 15]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter, defaultdict

DEVICE_CATS = {"kernel", "gpu_memset", "gpu_memcpy"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
SYNC_NAMES = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH", "cudaStreamWaitEvent")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", data) if isinstance(e, dict) and e.get("ph") == "X"]


class HostThreads:
    """Each host thread's ops as intervals, to ask which op chain covered a time."""

    def __init__(self, events: list[dict]):
        self.ops: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("cat") in DEVICE_CATS:
                continue
            self.ops[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        self.starts = {}
        for key, ops in self.ops.items():
            ops.sort(key=lambda op: (op[0], -op[1]))
            self.starts[key] = [op[0] for op in ops]

    def chain(self, thread: tuple, at: float, levels: int = 3) -> str:
        """The ops covering ``at`` on ``thread``, innermost first (``levels`` of them), or "(idle thread)"."""
        ops, i = self.ops.get(thread, []), bisect.bisect_right(self.starts.get(thread, []), at)
        covering = [op for op in ops[max(0, i - 4000):i] if op[1] >= at]
        covering.sort(key=lambda op: op[0], reverse=True)  # the latest-starting covering op is the innermost
        return " < ".join(op[2][:60] for op in covering[:levels]) or "(idle thread)"


def analyse(path: str, min_us: float, top: int) -> None:
    events = load(path)
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    host = HostThreads(events)
    if not device:
        print(f"{path}: no device events")
        return
    span = device[-1]["ts"] + device[-1].get("dur", 0) - device[0]["ts"]
    busy_until, late, late_by_launcher, early = device[0]["ts"] + device[0].get("dur", 0), Counter(), Counter(), 0.0
    counts, n_gaps, idle = Counter(), 0, 0.0
    for e in device[1:]:
        gap = e["ts"] - busy_until
        if gap >= min_us:
            n_gaps, idle = n_gaps + 1, idle + gap
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is None:
                late["(no launch record)"] += gap
                counts["(no launch record)"] += 1
            elif launch["ts"] <= busy_until:
                early += gap
                counts["(launched early)"] += 1
            else:
                thread = (launch["pid"], launch["tid"])
                where = f"[tid {launch['tid']}] {host.chain(thread, busy_until)}"
                late[where] += gap
                counts[where] += 1
                late_by_launcher[f"[tid {launch['tid']}] {host.chain(thread, launch['ts'] - 0.01)}"] += gap
        busy_until = max(busy_until, e["ts"] + e.get("dur", 0))
    syncs, sync_n = Counter(), Counter()
    for e in events:
        if e.get("cat") in LAUNCH_CATS and any(s in e["name"] for s in SYNC_NAMES):
            syncs[f"[tid {e['tid']}] {e['name']}"] += e.get("dur", 0)
            sync_n[f"[tid {e['tid']}] {e['name']}"] += 1
    print(f"=== {path}: device span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms in {n_gaps} gaps >= "
          f"{min_us:g} us; launched early (device-side waits) {early / 1e3:.1f} ms ({counts['(launched early)']})")
    print("  launched late, by what the launching thread was doing when the GPU ran dry (ms, gaps):")
    for where, us in late.most_common(top):
        print(f"  {us / 1e3:>8.1f} {counts[where]:>6}  {where[:160]}")
    print("  launched late, by the op that made the launch (ms):")
    for where, us in late_by_launcher.most_common(top):
        print(f"  {us / 1e3:>8.1f}  {where[:160]}")
    print("  synchronising runtime calls (ms, calls):")
    for where, us in syncs.most_common(top):
        print(f"  {us / 1e3:>8.1f} {sync_n[where]:>6}  {where[:160]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--min-us", type=float, default=10.0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    for path in args.traces:
        analyse(path, args.min_us, args.top)


if __name__ == "__main__":
    main()
