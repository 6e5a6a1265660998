"""Arms of bench/flow_grpo_step.py run in alternation on one machine, one table last: an A/B as bench/RESULTS.md
records one.

    python3 bench/ab.py --arm new= --arm "control=--constant model_specs.common.fp8.MIN_ROWS=256" --rounds 2 \
        --timeout 420 --budget 565 --min-run 200 --log-dir /tmp/ab -- \
        --random-transformer --compile default --compile-train default --steps 2 --skip-reference --fp8 --micro-batch 8
    python3 bench/ab.py ... --resume --log-dir /tmp/ab -- ...   # the next call (a warm machine): the runs still due
    python3 bench/ab.py --arm a= --arm "b=--set rollout.fuse=false" -- --smoke --steps 1 --skip-reference   # the CPU

An arm is ``NAME=FLAGS``: its own flags of bench/flow_grpo_step.py, after the ones every arm shares (those after
``--``).  Each run is a process of its own (nothing compiled or cached in memory leaks from one arm into the next;
inductor's on-disk cache is shared, so the first run of a cold machine is the slowest: put a throw-away arm first
or read the second round).  Rounds alternate the order -- A B, then B A -- so that a drift of the machine falls on
both arms.  A run's output goes to ``--log-dir``/<round>-<arm>.log, its numbers to <round>-<arm>.json; its step
lines are echoed as they come.  ``--timeout`` stops a run (its process group); ``--budget`` starts no run once
fewer seconds are left than the quickest run so far took (or ``--min-run``), and stops the run in flight when they
are spent (a device call's limit); the runs finished by then are kept and the table printed, as on SIGTERM (an
outer ``timeout``).  ``--resume`` reads the runs already in ``--log-dir`` and runs the rest (a folder that
outlives the call: the device's $OUT starts empty).  The table: per run the engine's sampling, train, sync, the DiT
side and end to end (images/s), the log-prob check and the peak; then per arm the medians, and each arm's DiT side
against the first arm's.  Exit status 1 when a run failed, timed out or was not started.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "flow_grpo_step.py"
ECHO = ("ours step", "Traceback")  # the lines of a run's output shown as it runs (and an exception's last line)


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME=FLAGS`` as (name, the flags split as a shell would); a ValueError naming the bad arm."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or any(c in name for c in "/ "):
        raise ValueError(f"--arm {text!r}: expected NAME=FLAGS (a name without '/' or spaces; FLAGS may be empty)")
    try:
        return name.strip(), shlex.split(flags)
    except ValueError as e:
        raise ValueError(f"--arm {text!r}: its flags do not split as a shell's words ({e})") from None


def run_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in the order they run: the arms as given in even rounds, reversed in odd ones."""
    return [(r, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def run_one(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group, its output to ``log`` (the ECHO lines also to stdout); (exit status, or
    None when it was stopped at ``timeout`` seconds; its wall seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        stopped = threading.Event()

        def stop() -> None:
            stopped.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                if line.startswith(ECHO) or line.split(":", 1)[0].endswith(("Error", "Exception")):
                    print(f"    {line.rstrip()}", flush=True)
            proc.wait()
        except BaseException:  # SIGTERM / Ctrl-C: the run's processes do not outlive this one
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            timer.cancel()
    return (None if stopped.is_set() else proc.returncode), time.perf_counter() - start


def read_run(path: Path) -> dict | None:
    """Ours' numbers from a run's JSON (bench/flow_grpo_step.py --json), the reference's DiT side beside them."""
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # no run, or one stopped while it wrote: run it (again)
        return None
    loops = record["loops"]
    ours = next(row for row in loops if row["name"].startswith("ours"))
    if ours["error"]:
        return {"error": ours["error"]}
    ref = [row for row in loops if not row["name"].startswith("ours") and not row["error"]]
    return dict({k: v for k, v in ours.items() if k != "error"}, device=record["device"],
                reference_dit=ref[0]["seconds"]["dit"] if ref else None)


def cells(run: dict) -> list[str]:
    """A table row's cells for one run (or an arm's medians)."""
    s, n, last = run["seconds"], run["images"], run.get("last", {})
    row = [f"{s['rollout_sampling']:.3f}", f"{s['train']:.3f}", f"{s['sync']:.3f}",
           f"{s['dit']:.3f} ({n / s['dit']:.3f})", f"{s['e2e']:.3f} ({n / s['e2e']:.3f})"]
    check = [f"{last[k]:.3g}" for k in ("logprob_abs_diff", "logprob_pearson") if k in last]
    row.append(", ".join(check) or "-")
    row.append(f"{run['peak_gib']:.1f}" if run.get("peak_gib") is not None else "-")
    row.append(f"{run['reference_dit'] / s['dit']:.2f} x" if run.get("reference_dit") else "-")
    return row


def arm_median(runs: list[dict]) -> dict:
    """The medians of an arm's runs, in a run's shape (the log-prob check: the worst run's)."""
    keys = runs[0]["seconds"].keys()
    worst = max(runs, key=lambda r: r.get("last", {}).get("logprob_abs_diff", 0.0))
    refs = [r["reference_dit"] for r in runs if r.get("reference_dit")]
    return {"seconds": {k: statistics.median(r["seconds"][k] for r in runs) for k in keys}, "images": runs[0]["images"],
            "last": worst.get("last", {}), "peak_gib": max((r["peak_gib"] for r in runs if r.get("peak_gib")),
                                                            default=None),
            "reference_dit": statistics.median(refs) if refs else None}


def print_table(title: str, order: list[tuple[int, str]], done: dict, names: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("round", "arm", "sampling s", "train s", "sync s", "DiT side s (images/s)", "end to end s (images/s)",
                "log-prob abs(Δ), Pearson", "peak GiB", "reference / ours"):
        table.add_column(col, justify="left" if col in ("round", "arm") else "right")
    for key in order:
        run = done.get(key, {"error": "not started"})
        table.add_row(str(key[0] + 1), key[1], *(cells(run) if "seconds" in run else [run["error"]] + [""] * 7))
    table.add_section()
    medians = {}
    for name in names:
        runs = [run for (_, arm), run in done.items() if arm == name and "seconds" in run]
        if runs:
            medians[name] = (len(runs), arm_median(runs))
    for name, (count, med) in medians.items():
        change, base = "", medians.get(names[0], (0, None))[1]
        if name != names[0] and base is not None:
            change = f"; DiT side {med['seconds']['dit'] / base['seconds']['dit'] - 1:+.2%} vs {names[0]}"
        table.add_row("median", f"{name} ({count} run{'s' if count > 1 else ''}{change})", *cells(med))
    Console(width=220).print(table)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_all(order: list[tuple[int, str]], arms: dict[str, list[str]], common: list[str], args, log_dir: Path,
            done: dict) -> None:
    """Run (or, with --resume, read) each (round, arm) of ``order`` into ``done`` until --budget is spent."""
    start, quickest = time.perf_counter(), None
    for key in order:
        left = None if args.budget is None else args.budget - (time.perf_counter() - start)
        need = args.min_run if args.min_run is not None else quickest
        if left is not None and (left <= 0 or (need is not None and left < need)):
            print(f"  {max(left, 0):.0f} s of --budget left, under a run's {need or 0:.0f} s: the rest not started",
                  flush=True)
            return
        stem = f"{key[0] + 1}-{key[1]}"  # (not Path.with_suffix: an arm's name may hold a dot)
        numbers, log = log_dir / f"{stem}.json", log_dir / f"{stem}.log"
        if args.resume and (run := read_run(numbers)) is not None:
            done[key] = run
            print(f"  round {key[0] + 1}, {key[1]}: read from {numbers} (--resume)", flush=True)
            continue
        numbers.unlink(missing_ok=True)  # an earlier A/B's numbers in this folder are not this run's
        cmd = [sys.executable, str(SCRIPT), *common, *arms[key[1]], "--json", str(numbers)]
        print(f"  round {key[0] + 1}, {key[1]}: {shlex.join(cmd[1:])}", flush=True)
        try:
            status, wall = run_one(cmd, log, args.timeout if left is None else min(args.timeout, left))
        except KeyboardInterrupt:
            done[key] = {"error": "interrupted (SIGTERM / Ctrl-C)"}
            raise
        run = read_run(numbers) if status == 0 else None
        if run is None:
            tail = (log.read_text().strip().splitlines() or ["no output"])[-1]
            run = {"error": f"stopped after {wall:.0f} s" if status is None else f"exit {status}: {tail[:150]}"}
        else:
            quickest = wall if quickest is None else min(quickest, wall)
        done[key] = run
        print(f"  ... {wall:.0f} s" + (f": {run['error']}" if "error" in run else ""), flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, common = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --arm NAME=FLAGS [--arm ...] [options] -- COMMON FLAGS")
    p.add_argument("--arm", action="append", required=True, metavar="NAME=FLAGS",
                   help="one arm: its name, '=', its own flags of bench/flow_grpo_step.py (repeatable; two or more)")
    p.add_argument("--rounds", type=int, default=2, help="runs per arm, the order alternating (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is stopped")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole A/B: no run starts once fewer are left than the quickest run took, "
                        "and a run is stopped when they are spent")
    p.add_argument("--min-run", type=float, default=None, metavar="S",
                   help="with --budget: the seconds a run needs at the least (default: the quickest run so far took; "
                        "a cold machine's first run is the slowest, so give a warm run's time to start a second)")
    p.add_argument("--log-dir", metavar="DIR", help="each run's output and JSON (default: a new temporary folder)")
    p.add_argument("--resume", action="store_true",
                   help="a run whose JSON is already in --log-dir is read, not run again (an A/B over device calls)")
    args = p.parse_args(own)
    try:
        arms = dict(parse_arm(text) for text in args.arm)
    except ValueError as e:
        p.error(str(e))
    if len(arms) < 2 or len(arms) != len(args.arm):
        p.error(f"--arm {' '.join(args.arm)}: expected two or more arms with distinct names")
    if args.rounds < 1 or args.timeout <= 0:
        p.error(f"--rounds {args.rounds}, --timeout {args.timeout}: expected an integer >= 1 and seconds > 0")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_ab_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    names, order, done = list(arms), run_order(list(arms), args.rounds), {}
    print(f"A/B of {len(names)} arms x {args.rounds} rounds; logs in {log_dir}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_all(order, arms, common, args, log_dir, done)
    except KeyboardInterrupt:
        print("  interrupted: the runs finished so far are in the table", flush=True)
    devices = sorted({run["device"] for run in done.values() if "device" in run}) or ["no run finished"]
    print_table(f"bench/ab.py on {', '.join(devices)}: {shlex.join(common)}", order, done, names)
    return 0 if all("seconds" in done.get(key, {}) for key in order) else 1


if __name__ == "__main__":
    sys.exit(main())
