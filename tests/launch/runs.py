"""What the launch tests share: a tiny digits run's command line (the overrides of tests/trainer/test_flow_grpo.py,
4 pairs per micro-batch so that 2 data-parallel ranks divide the step's 8), its environment and its metrics."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from tests.trainer.test_flow_grpo import TIMING, TINY

REPO = Path(__file__).resolve().parents[2]
DIGITS = ["train", "--recipe", "digits_flow_grpo", *TINY, "train.micro_batch_size=4", "train.save_every=0"]


def train_args(run_dir: Path, steps: int) -> list[str]:
    return [*DIGITS, f"train.steps={steps}", f"train.output_dir={run_dir}"]


def cli(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "megatron_omni.cli", *train_args(run_dir, steps)]


def env(**extra: str) -> dict[str, str]:
    """One intra-op thread per rank: several ranks share the 2 cores of a test machine."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    # complete lines only: the run may be writing the next one
    lines = [line for line in path.read_text().split("\n")[:-1] if line.strip()]
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def wait_for_steps(run_dir: Path, n: int, alive, timeout_s: float = 300) -> None:
    """Until ``n`` steps are logged; ``alive()`` False (the run ended first) or the timeout is an error."""
    deadline = time.monotonic() + timeout_s
    while len(metrics(run_dir)) < n:
        if not alive() or time.monotonic() > deadline:
            raise AssertionError(f"{run_dir}: {len(metrics(run_dir))} steps logged, the run "
                                 f"{'timed out' if alive() else 'ended'} before step {n}")
        time.sleep(0.05)


def latest_checkpoint(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text())


def rendezvous(log: str) -> tuple[set[str], set[str]]:
    """The group ranks and group world sizes that torchrun agents logged (LOGLEVEL=INFO) as their rendezvous result:
    ({"0", "1"}, {"2"}) when two agents formed one world."""
    return set(re.findall(r"\]\s+group_rank=(\d+)", log)), set(re.findall(r"\]\s+group_world_size=(\d+)", log))
