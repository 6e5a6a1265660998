"""The GPU-only benches (no CPU mode) still import and parse their options: ``--help`` runs each script's imports
and argument parser without a GPU."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,option", [("rollout_forward.py", "--modulation"), ("lora_projection.py", "--repeats"),
                                           ("attention_mask.py", "--repeats"), ("gemm_shapes.py", "--rollout-batch"),
                                           ("qk_norm_rope.py", "--batch"), ("fp8_gemm.py", "--rows"),
                                           ("gelu_quantize.py", "--text-tokens"), ("fp8_attention.py", "--tokens"),
                                           ("norm_quantize.py", "--text-tokens"), ("sdpa_host.py", "--queue-ms")])
def test_help(script, option):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert option in out.stdout
