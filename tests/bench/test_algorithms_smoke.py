"""bench/algorithms.py --smoke: every registered algorithm (FlowGRPO once per sampler) trains on the tiny digits run
from the demo's pretraining at one budget, is evaluated before / half-way / at the end, and lands in the table and
the plot."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_omni.algorithms import algorithm_names

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_writes_the_table_and_the_plot(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "algorithms.py"), "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # tiny models: one thread is faster on 2 cores
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    labels = {r["label"] for r in summary["results"]}
    assert labels == ({n for n in algorithm_names() if n != "flow_grpo"}
                      | {"flow_grpo (sde)", "flow_grpo (cps)", "flow_grpo (dance)"})
    budget = summary["budget_flops"]
    for r in summary["results"]:
        probe = summary["probe_step_flops"][r["label"]]
        assert r["steps"] == max(1, round(budget / probe))  # the cell's steps fill the budget
        assert [p["steps"] for p in r["points"]] == ([r["steps"] // 2, r["steps"]] if r["steps"] >= 2 else [1])
        spent = r["points"][-1]["flops"]  # within half a step of the budget (steps differ a little: text lengths)
        assert abs(spent - budget) <= 0.5 * probe + 0.1 * spent
        assert all(0 <= p["judge"] <= 1 and 0 <= p["reward"] <= 1 for p in r["points"])
    table = (tmp_path / "table").with_suffix(".md").read_text()
    assert all(f"| {label} |" in table for label in labels)
    assert (tmp_path / "judge_vs_forwards.png").stat().st_size > 10_000
