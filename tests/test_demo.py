"""The main job (`make demo`) runs end to end and its summary holds the parity numbers it printed."""
import json

import pytest

from megatron_omni.demo_convert import main

pytestmark = pytest.mark.numerics  # our model's forward against diffusers' at TP=1 and TP=2


def test_demo_converts_checks_parity_and_writes_summary(tmp_path):
    assert main(["--out", str(tmp_path / "demo")]) == 0
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["tensors_bit_exact"] == summary["tensors"] > 100
    assert summary["rel_err_tp1_vs_diffusers"] <= 1e-5
    assert summary["rel_err_tp2_vs_diffusers"] <= 1e-5
