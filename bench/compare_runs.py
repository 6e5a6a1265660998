"""Two or more runs' learning curves side by side, from their ``metrics.jsonl`` (what ``megatron-omni train`` writes).

    python3 bench/compare_runs.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl --labels bf16 fp8 --out curves.png

Prints, per run, the reward and held-out judge at the start (mean of the first ``--window`` steps) and at the end
(the last ``--window``), the median step time and the log-prob check (mean |Δ log p|, lowest Pearson r), and
plots reward and judge against the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no metrics (expected one JSON object per line, as metrics.jsonl holds)")
    return rows


def summary(rows: list[dict], window: int) -> dict[str, float]:
    def mean(key: str, part: list[dict]) -> float:
        values = [r[key] for r in part if key in r]
        return statistics.mean(values) if values else float("nan")

    head, tail = rows[:window], rows[-window:]
    out = {"steps": len(rows), "reward_start": mean("reward_mean", head), "reward_end": mean("reward_mean", tail),
           "judge_start": mean("judge_mean", head), "judge_end": mean("judge_mean", tail),
           "step_seconds": statistics.median(r["step_seconds"] for r in rows[1:] or rows)}
    if any("logprob_abs_diff" in r for r in rows):
        out["logprob_abs_diff"] = mean("logprob_abs_diff", rows)
        out["logprob_pearson_min"] = min(r["logprob_pearson"] for r in rows if "logprob_pearson" in r)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, metavar="METRICS_JSONL")
    p.add_argument("--labels", nargs="+", help="one name per run (default: the run folders' names)")
    p.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    p.add_argument("--out", type=Path, help="write the plot here (PNG)")
    args = p.parse_args(argv)
    labels = args.labels or [r.parent.name for r in args.runs]
    if len(labels) != len(args.runs):
        p.error(f"{len(labels)} labels for {len(args.runs)} runs; expected one per run")
    if args.window < 1:
        p.error(f"--window {args.window}: expected an integer >= 1")
    runs = {label: load(path) for label, path in zip(labels, args.runs)}
    keys = ("steps", "reward_start", "reward_end", "judge_start", "judge_end", "step_seconds", "logprob_abs_diff",
            "logprob_pearson_min")
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, rows in runs.items():
        s = summary(rows, args.window)
        cells = [("-" if k not in s else f"{s[k]:.7f}" if k == "logprob_pearson_min" else f"{s[k]:.4g}") for k in keys]
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
        for label, rows in runs.items():
            steps = [r["step"] for r in rows]
            for ax, key in zip(axes, ("reward_mean", "judge_mean")):
                ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label)
        for ax, title in zip(axes, ("reward", "held-out judge")):
            ax.set_title(title)
            ax.set_xlabel("RL step")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
