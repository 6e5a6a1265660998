"""bench/flow_grpo_step.py --smoke times the product's own RL step (megatron_omni.trainer.loop.rl_step on a run
built by build_run from the qwen_image_flow_grpo recipe and a tiny pipeline folder) beside the diffusers + peft
reference on the CPU, and prints its table (times mean nothing there); both loops re-score their own rollout
exactly."""
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
    # the loop's own phases (rl_step's <phase>_seconds), its step_seconds end to end, and the reference beside it
    rows = {(m.group(1).strip(), m.group(2).strip()) for m in re.finditer(r"^│ ([^│]+)│ ([^│]+)│", text, re.M)}
    ours = "ours: megatron-omni train's rl_step (eager)"
    for phase in ("rollout", "rollout_sampling", "rollout_scoring", "reward", "train", "sync",
                  "DiT side: sampling + train + sync", "rollout (decode incl.) + train + sync",
                  "end to end: the loop's step_seconds"):
        assert (ours, phase) in rows, (phase, sorted(rows))
    # the rollout's parts (the engine's sampling, then the decode and the reward submission) lie inside it
    secs = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(
        r"^│ ours: megatron-omni train's rl_step \(eager\)\s*│ ([^│]+)│\s*([0-9.]+)", text, re.M)}
    assert 0 < secs["rollout_sampling"] and 0 < secs["rollout_scoring"], secs
    assert secs["rollout_sampling"] + secs["rollout_scoring"] <= secs["rollout"] + 1e-3, secs
    assert secs["DiT side: sampling + train + sync"] < secs["rollout (decode incl.) + train + sync"], secs
    for phase in ("rollout", "train", "DiT side: rollout + train"):
        assert ("reference (diffusers + peft)", phase) in rows, phase
    assert ("ours / reference", "DiT-side speed-up") in rows
    assert "qwen_image_flow_grpo" in text and "tiny random QwenImagePipeline folder" in text
    # logprob_abs_diff is the loop's own log-prob check (megatron_omni.algorithms.flow_grpo.FlowGRPO.check):
    # float32 on the CPU, the trainer re-scores the rollout to rounding
    line = re.search(r"rl_step \(eager\), last step \(the loop's metrics\): logprob_abs_diff (\S+), logprob_pearson",
                     text)
    assert line and float(line.group(1)) < 1e-6, text[-3000:]
    line = re.search(r"^reference \(diffusers \+ peft\), last step: 8 trained pairs, ratio_mean 1, rms_log_ratio "
                     r"(\S+),", text, re.M)
    assert line and float(line.group(1)) < 1e-6, text[-3000:]


@pytest.mark.slow  # multi-rank: not rerun under avx2 (as tests/trainer/test_loop_layouts.py)
def test_smoke_under_torchrun_at_pp2_prints_one_table():
    """The bench drives the loop at a layout: 2 ranks (torchrun, gloo on the CPU), PP = 2; one table (rank 0)."""
    from megatron_omni.parallel.state import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "bench" / "flow_grpo_step.py"), "--smoke", "--steps", "1", "--pp", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("FlowGRPO step of qwen_image_flow_grpo") == 1, out.stdout[-3000:]
    assert "2 ranks (torchrun): tp 1 x cp 1 x pp 2 x dp 1" in out.stdout
    line = re.search(r"last step \(the loop's metrics\): logprob_abs_diff (\S+),", out.stdout)
    assert line and float(line.group(1)) < 1e-6, out.stdout[-3000:]


def test_a_device_too_small_is_refused_before_the_run_is_built(monkeypatch, capsys):
    """The bench holds the run's memory estimate against the device before build_run (as `megatron-omni train`
    does): the table's row says why, and the reference (same shape) is not run."""
    from megatron_omni.trainer import run

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import flow_grpo_step

    monkeypatch.setattr(run, "device_memory", lambda state: 1 << 20)  # a 1 MiB accelerator
    flow_grpo_step.main(["--smoke", "--steps", "1"])
    out = capsys.readouterr().out
    assert "this layout does not fit the device: an estimated" in out, out[-3000:]
    rows = re.findall(r"^│ ([^│]*?)\s*│ ([^│]*?)\s*│", out, re.M)
    assert rows and {loop for loop, _ in rows} == {"ours: megatron-omni train's rl_step (eager)", ""}, rows
    assert not any(phase.startswith("rollout_sampling") for _, phase in rows), rows


def test_inductor_options_are_set_or_refused_by_name(monkeypatch):
    """--inductor KEY=VALUE sets torch._inductor.config.KEY to the literal; an unknown key or a value that is not a
    Python literal is one error naming it."""
    import torch._inductor.config as inductor

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import flow_grpo_step

    monkeypatch.setattr(inductor, "combo_kernels", False)
    assert flow_grpo_step.set_inductor("combo_kernels=True") is None and inductor.combo_kernels is True
    assert "KEY an option of torch._inductor.config" in flow_grpo_step.set_inductor("no_such_option=1")
    assert "'tru' is not a Python literal" in flow_grpo_step.set_inductor("combo_kernels=tru")
    assert inductor.combo_kernels is True  # a refused value leaves the option as it was
