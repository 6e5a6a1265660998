"""One object that records a run's step metrics everywhere they go.

- console: a progress line every ``log_every`` steps and at the last (step, ETA, reward, judge, loss);
- ``metrics.jsonl``: one JSON object per step, flushed at once; on resume, lines from the resumed
  step on are dropped first, so the file continues exactly as an uninterrupted run would have;
- wandb: offline by default (no account or network), "online" when asked, "disabled" to skip;
- pictures: sample grids every ``image_every`` steps and a reward curve at the end.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from megatron_omni.logging.grids import labelled_grid
from megatron_omni.logging.images import curve_plot, image_grid


class RunLogger:
    def __init__(self, run_dir: Path, total_steps: int, wandb_mode: str = "offline", project: str = "megatron-omni",
                 config: dict | None = None, start_step: int = 0, curve_keys: tuple[str, ...] = ("reward_mean",),
                 log_every: int = 1, enabled: bool = True):
        """``enabled=False``: a rank that does not write (under torch.distributed one rank logs the step's metrics,
        which every replica holds alike): nothing is written, printed or sent."""
        self.run_dir, self.total_steps, self.curve_keys = Path(run_dir), total_steps, curve_keys
        self.log_every, self.enabled = log_every, enabled
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._t0, self._steps_done = time.perf_counter(), 0
        self.history, self._wandb = [], None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.history = self._truncate_from(start_step)
        self._wandb = self._start_wandb(wandb_mode, project, config)

    def _truncate_from(self, start_step: int) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        kept = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]
        kept = [m for m in kept if m["step"] < start_step]
        self.metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        return kept

    def _start_wandb(self, mode: str, project: str, config: dict | None):
        if mode == "disabled":
            return None
        import os

        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        return wandb.init(project=project, mode=mode, dir=str(self.run_dir), config=config or {},
                          resume="allow", id=self.run_dir.resolve().name.replace("/", "-"))

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.history.append(record)
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        self._steps_done += 1
        if (step + 1) % self.log_every and step != self.total_steps - 1:
            return
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / self._steps_done * (self.total_steps - step - 1)
        shown = "  ".join(f"{k} {record[k]:.3f}" for k in ("reward_mean", "judge_mean", "loss") if k in record)
        print(f"step {step + 1}/{self.total_steps}  {shown}  ({record.get('step_seconds', 0):.1f} s/step, "
              f"ETA {eta:.0f} s)", flush=True)

    def log_images(self, step: int, images: torch.Tensor, name: str = "samples",
                   labels: list[str] | None = None) -> Path:
        """A grid of ``images`` ([N, H, W] gray or [N, C, H, W], in [0, 1]), each tile labelled with its
        ``labels[i]`` (prompt and reward) when given."""
        path = self.run_dir / f"{name}_step{step:05d}.png"
        if not self.enabled:
            return path
        path = image_grid(images, path) if labels is None else labelled_grid(images, labels, path)
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Image(str(path))}, step=step)
        return path

    def finish(self) -> Path:
        if not self.enabled:
            return self.run_dir / "reward_curve.png"
        steps = [m["step"] for m in self.history]
        series = {k: [m[k] for m in self.history if k in m] for k in self.curve_keys}
        path = curve_plot(steps, series, self.run_dir / "reward_curve.png", "reward per RL step")
        if self._wandb is not None:
            self._wandb.finish()
        return path


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value
