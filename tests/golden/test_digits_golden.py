"""Golden metrics of the digits recipe at a fixed seed: the guard of every refactor of the loop.

Each case runs ``megatron-omni train --recipe digits_flow_grpo`` (in process, through the CLI's own entry point)
for 3 RL steps and compares every non-timing metric of every step with ``digits_metrics.json``.

Recorded on the machine named in the file with ``python tests/golden/test_digits_golden.py --record``; a refactor
is checked there with ``--check-exact`` (every number identical).  The pytest form allows float32 rounding: other
CPUs take other float32 kernels (docs/benchmarks.md, "CPU kernels differ"), and 3 RL steps carry a 1e-7
difference of one GEMM through sampling, rewards and Adam to ~1e-5 relative; a changed formula, seed, schedule
or ordering moves these metrics by far more (rewards and losses by > 1e-2).
"""
from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import pytest

from megatron_omni.trainer.loop import TIMING_METRICS as TIMING

GOLDEN = Path(__file__).with_name("digits_metrics.json")
BASE = ["train.steps=3", "train.save_every=0", "train.micro_batch_size=8", "train.global_batch_size=8",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled", "model.arch.num_layers=2"]
CASES = {
    "full_sde": BASE,
    "lora_cfg_kl": BASE + ["lora.rank=4", "lora.alpha=8", "algorithm.kl_beta=0.01", "rollout.guidance_scale=3.0"],
}
RTOL, ATOL = 1e-4, 1e-6  # see the module docstring; ATOL for metrics that are ~0 by construction (clipfracs, kl)

pytestmark = pytest.mark.numerics


def run_case(name: str, out_dir: Path) -> list[dict]:
    from megatron_omni.cli import main

    code = main(["train", "--recipe", "digits_flow_grpo", *CASES[name], f"train.output_dir={out_dir}"])
    if code != 0:
        raise RuntimeError(f"golden case {name}: megatron-omni train exited {code}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def _differences(got: list[dict], want: list[dict], rtol: float, atol: float) -> list[str]:
    if len(got) != len(want):
        return [f"{len(got)} steps logged; expected {len(want)}"]
    out = []
    for g, w in zip(got, want):
        for key in sorted(set(g) | set(w)):
            a, b = g.get(key), w.get(key)
            if isinstance(a, float) and isinstance(b, float):
                if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol):
                    out.append(f"step {w['step']} {key}: {a!r} vs golden {b!r}")
            elif a != b:
                out.append(f"step {w['step']} {key}: {a!r} vs golden {b!r}")
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_digits_metrics_match_golden(tmp_path, name):
    want = json.loads(GOLDEN.read_text())["cases"][name]
    diffs = _differences(run_case(name, tmp_path / name), want, RTOL, ATOL)
    assert not diffs, "\n".join(diffs[:20])


if __name__ == "__main__":  # --record: write the golden file; --check-exact: compare every number exactly
    import tempfile

    mode = sys.argv[1] if len(sys.argv) > 1 else "--check-exact"
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_case(name, Path(tmp) / name) for name in sorted(CASES)}
    if mode == "--record":
        GOLDEN.write_text(json.dumps({"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                                      "cases": results}, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    else:
        golden = json.loads(GOLDEN.read_text())["cases"]
        bad = {name: _differences(results[name], golden[name], 0.0, 0.0) for name in sorted(CASES)}
        for name, diffs in bad.items():
            print(f"{name}: {'identical' if not diffs else f'{len(diffs)} differences'}")
            for line in diffs[:20]:
                print("  " + line)
        sys.exit(1 if any(bad.values()) else 0)
