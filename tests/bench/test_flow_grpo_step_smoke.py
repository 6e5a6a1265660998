"""bench/flow_grpo_step.py --smoke runs ours and the diffusers + peft reference end to end on the CPU and
prints its table (times mean nothing there); both loops re-score their own rollout exactly."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.numerics  # trainer log-probs against the rollout's, ours and the diffusers + peft loop


def test_smoke_prints_the_table():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "flow_grpo_step.py"), "--smoke", "--steps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for phase in ("text", "rollout", "decode", "reward", "train", "sync", "DiT side", "end to end", "speed-up"):
        assert phase in text, phase
    assert "reference (diffusers + peft)" in text and "jpeg_compressibility" in text
    # float32 on the CPU: the trainer's log-probs equal the rollout's, nothing is clipped
    for loop in ("ours", "reference"):
        line = re.search(rf"^{loop}.*last step: 32 trained pairs, ratio_mean 1, rms_log_ratio (\S+),", text, re.M)
        assert line and float(line.group(1)) < 1e-6, text[-2000:]
