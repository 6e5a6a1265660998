"""bench/layouts.py --smoke drives the product's loop (build_run + rl_step of the qwen_image_flow_grpo recipe on a
tiny pipeline folder) at several layouts in one torchrun launch on CPU gloo, and prints one table on rank 0; a
layout the config refuses is one row with the refusal, the others still run."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # the loop's log-prob check at each layout (slow: multi-rank,
# not rerun under avx2, as tests/trainer/test_loop_layouts.py)


def test_smoke_at_two_ranks_prints_one_row_per_layout():
    from megatron_omni.parallel.state import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "bench" / "layouts.py"), "--smoke", "--steps", "1", "--warmup", "0",
           "--layout", "tp=2", "--layout", "pp=2", "--layout", "pp=1", "--layout", "tp=3"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.count("RL step of qwen_image_flow_grpo at each layout, 2 ranks") == 1, text[-3000:]
    rows = {m.group(1).strip(): [c.strip() for c in m.group(2).split("│")]
            for m in re.finditer(r"^│ (DP[^│]+)│(.+)│$", text, re.M)}
    for name in ("DP1 x TP2 x CP1 x PP1", "DP1 x TP1 x CP1 x PP2", "DP2 x TP1 x CP1 x PP1"):
        seconds, per_gpu, *_, logprob_gap = rows[name]
        assert float(seconds) > 0 and float(per_gpu) > 0, (name, rows[name])
        assert float(logprob_gap) < 1e-6, (name, rows[name])  # the trainer re-scores the rollout at every layout
    refused = rows["DP? x TP3 x CP1 x PP1"][0]
    assert refused.startswith("refused: model.arch: tensor-parallel size 3 does not divide"), refused


def test_layout_spec_errors_name_the_bad_part():
    sys.path.insert(0, str(ROOT / "bench"))
    from layouts import parse_layout

    assert parse_layout("tp=2,pp=2,vpp=2") == {"tp": 2, "cp": 1, "ulysses": 1, "pp": 2, "vpp": 2}
    for bad in ("tp=0", "tpp=2", "tp2"):
        with pytest.raises(ValueError, match=f"part {bad!r}; expected comma-separated size=integer >= 1"):
            parse_layout(bad)
