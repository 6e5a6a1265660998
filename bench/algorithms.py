"""Every registered RL algorithm (and FlowGRPO with the SDE, CPS and Dance samplers) on the digits task at one
compute budget, 3 seeds each: one table and one plot.

    python bench/algorithms.py [--base-steps 6] [--seeds 0 1 2] [--pretrained DIR] [--out DIR] [--plot PNG]
    python bench/algorithms.py --smoke      # a tiny model, 1 seed, 2 steps: checks the script runs end to end

The product runs every cell: ``megatron-omni train --recipe digits_flow_grpo algorithm.name=<name>`` (in process,
megatron_omni.trainer.loop.train) from one pretrained checkpoint, the demo's (megatron_omni.demo: flow matching on
the handwritten digits; ``--pretrained`` reuses a folder it wrote, e.g. ``runs/demo/pretrained``), evaluated as the
demo evaluates (megatron_omni.demo.evaluate: 10 digits x 8 fixed seeds, sampled as the recipe samples, scored by the
CNN reward and the held-out SVC judge) before RL, half-way and at the end.

The budget: the same DiT FLOPs per run, counted by each algorithm's own ``flops`` (the loop logs it per step as
tflops_per_second x step_seconds: rollout forwards, training forwards + backwards, old-policy / reference / check
passes), stated in row-forwards (one DiT forward of one 16x16 digit at the prompts' mean text length).  It is
``--base-steps`` RL steps of FlowGRPO (SDE); every other cell runs round(budget / its probed step cost) steps (a
one-step probe at seed 0 measures that cost), so the forwards actually spent differ by under half a step; the table
gives them.  The half-way evaluation splits a run in two ``train`` calls (the second resumes the first's
checkpoint: the loop's resume is bit-exact).  FlowGRPO (CPS) draws its SDE window's start from 0 .. num_steps −
window − 1: CPS's last step has std 0, so no window may reach it (the other cells keep the recipe's any-start).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the shrunk recipe of tests/algorithms/test_algorithm_runs.py: 2 prompts x 4 samples, a 2-step window, 2 layers
SMOKE = ["train.micro_batch_size=8", "train.global_batch_size=16", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2", "rollout.window_range=[0,1]",
         "algorithm.logprob_check_samples=8", "model.arch.num_layers=2"]
BASELINE = "flow_grpo (sde)"


def cells(cfg) -> dict[str, list[str]]:
    """label -> overrides: every registered algorithm, FlowGRPO once per sampler (``cfg``: the common run config)."""
    from megatron_omni.algorithms import algorithm_names

    out = {}
    for name in algorithm_names():
        if name == "flow_grpo":
            for sampler in ("sde", "cps", "dance"):
                out[f"flow_grpo ({sampler})"] = ["algorithm.name=flow_grpo", f"rollout.sampler={sampler}"]
            # CPS's last step has std 0 (no Gaussian log-prob): its window starts early enough to end before it
            last_start = cfg.rollout.num_steps - cfg.rollout.window_size - 1
            out["flow_grpo (cps)"].append(f"rollout.window_range=[0,{last_start}]")
        else:
            out[name] = [f"algorithm.name={name}"]
    return out


def step_flops(metrics: dict) -> float:
    """The step's DiT FLOPs as the loop counted them (its tflops_per_second over step_seconds)."""
    return metrics["tflops_per_second"] * 1e12 * metrics["step_seconds"]


def row_forward_flops(cfg, task) -> float:
    """One DiT forward of one digit at the digit prompts' mean text length (the engine's layout)."""
    from megatron_omni.data.text_layout import padded_length
    from megatron_omni.trainer.mfu import forward_flops

    _, mask = task.encode(task.prompts)
    lengths = [padded_length([int(m.sum())], cfg.rollout.text_pad_multiple) for m in mask]
    fhw = task.img_fhw
    return forward_flops(cfg.model.arch, 1, fhw[0] * fhw[1] * fhw[2], round(sum(lengths) / len(lengths)))


class Bench:
    def __init__(self, args):
        from megatron_omni.config import load_config
        from megatron_omni.data.tasks import build_task
        from megatron_omni.parallel.state import init_parallel
        from megatron_omni.rewards import build_reward

        self.args, self.out = args, Path(args.out)
        self.common = (SMOKE if args.smoke else []) + ["logging.wandb_mode=disabled", "train.eval_every=0"]
        self.cfg = load_config("digits_flow_grpo", None, self.common)
        self.state = init_parallel(seed=self.cfg.train.seed, device=self.cfg.parallel.device)
        self.task = build_task(self.cfg.data.task, self.cfg.data.text_max_tokens)
        self.judges = {"reward": build_reward(self.cfg.reward.name), "judge": build_reward(self.cfg.reward.judge)}

    def pretrained(self) -> tuple[str, dict]:
        """The checkpoint every cell starts from and its evaluation (the demo's pretraining, or ``--pretrained``)."""
        from checkpoints_convert.mcore_checkpoint import load_model
        from megatron_omni.demo import _pretrain, evaluate
        from megatron_omni.trainer.policy import build_policy

        if self.args.pretrained:
            path = Path(self.args.pretrained)
            policy = build_policy(self.cfg.model.arch, self.state, lr=1e-3)
            load_model(policy.module, path)
        else:
            policy, _ = _pretrain(self.cfg, self.state, self.task, self.out, self.args.pretrain_steps)
            path = self.out / "pretrained"
        return str(path.resolve()), evaluate(policy, self.task, self.cfg, self.judges)

    def train(self, label: str, overrides: list[str], seed: int, steps: int, ckpt: str, stop: int | None = None):
        """(run, metrics of the steps run) of ``train.steps=steps``; ``stop``: resume there (a second segment)."""
        from megatron_omni.config import load_config
        from megatron_omni.trainer.loop import train

        cfg = load_config("digits_flow_grpo", None, [*self.common, *overrides, f"train.seed={seed}",
                                                     f"train.steps={steps}", "train.save_every=0",
                                                     f"model.mcore_path={ckpt}"])
        run_dir = self.out / "runs" / label.replace(" ", "_").replace("(", "").replace(")", "") / f"seed{seed}"
        return train(cfg, self.state, self.task, run_dir, resume=stop is not None)

    def cell(self, label: str, overrides: list[str], seed: int, steps: int, ckpt: str) -> dict:
        from megatron_omni.demo import evaluate

        half = steps // 2 if steps >= 2 else None
        points, flops, t0 = [], 0.0, time.perf_counter()
        for segment_end in ([half] if half else []) + [steps]:
            run, done = self.train(label, overrides, seed, segment_end, ckpt,
                                   stop=None if segment_end == (half or steps) else half)
            flops += sum(step_flops(m) for m in done)
            t_eval = time.perf_counter()
            # every cell evaluated alike: the recipe's sampler, whatever sampler the cell trains with
            scores = evaluate(run.policy, self.task, self.cfg, self.judges)
            points.append({"steps": segment_end, "flops": flops, **scores})
            t0 += time.perf_counter() - t_eval  # wall time of training only
        return {"label": label, "seed": seed, "steps": steps, "points": points,
                "train_wall_s": time.perf_counter() - t0}

    def run(self) -> dict:
        ckpt, before = self.pretrained()
        print(f"pretrained {ckpt}: reward {before['reward']:.3f} judge {before['judge']:.3f}", flush=True)
        probes = {}
        for label, overrides in cells(self.cfg).items():
            _, done = self.train(f"probe {label}", overrides, 0, 1, ckpt)
            probes[label] = step_flops(done[0])
        budget = self.args.base_steps * probes[BASELINE]
        unit = row_forward_flops(self.cfg, self.task)
        results = []
        for label, overrides in cells(self.cfg).items():
            steps = max(1, round(budget / probes[label]))
            for seed in self.args.seeds:
                r = self.cell(label, overrides, seed, steps, ckpt)
                results.append(r)
                end = r["points"][-1]
                print(f"{label} seed {seed}: {steps} steps, {end['flops'] / unit:.0f} row-forwards, reward "
                      f"{end['reward']:.3f} judge {end['judge']:.3f}, {r['train_wall_s']:.0f} s", flush=True)
        return {"before": before, "budget_flops": budget, "row_forward_flops": unit, "probe_step_flops": probes,
                "base_steps": self.args.base_steps, "seeds": self.args.seeds, "results": results}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(summary: dict) -> str:
    """Markdown: per cell the steps, forwards spent, reward / judge after (mean ± std over seeds), the judge −
    reward gap after, and the judge's difference to FlowGRPO (SDE)."""
    before, unit = summary["before"], summary["row_forward_flops"]
    by_label: dict[str, list[dict]] = {}
    for r in summary["results"]:
        by_label.setdefault(r["label"], []).append(r)
    base_judge = _mean_std([r["points"][-1]["judge"] for r in by_label[BASELINE]])[0]
    lines = [f"Before RL (the pretrained checkpoint, same for every cell): reward {before['reward']:.3f}, judge "
             f"{before['judge']:.3f}, judge − reward {before['judge'] - before['reward']:+.3f}.  Budget "
             f"{summary['budget_flops'] / unit:.0f} row-forwards ({summary['budget_flops'] / 1e12:.2f} TFLOP) per "
             f"run; {len(summary['seeds'])} seeds; mean ± std over seeds.", "",
             "| algorithm | RL steps | row-forwards spent | reward after | judge after | judge − reward after "
             "| judge vs FlowGRPO (sde) | train wall s |", "|---|---|---|---|---|---|---|---|"]
    for label, runs in by_label.items():
        ends = [r["points"][-1] for r in runs]
        fw = _mean_std([e["flops"] / unit for e in ends])
        rew, jud = _mean_std([e["reward"] for e in ends]), _mean_std([e["judge"] for e in ends])
        gap = _mean_std([e["judge"] - e["reward"] for e in ends])
        wall = _mean_std([r["train_wall_s"] for r in runs])
        lines.append(f"| {label} | {runs[0]['steps']} | {fw[0]:.0f} | {rew[0]:.3f} ± {rew[1]:.3f} | "
                     f"{jud[0]:.3f} ± {jud[1]:.3f} | {gap[0]:+.3f} ± {gap[1]:.3f} | {jud[0] - base_judge:+.3f} | "
                     f"{wall[0]:.0f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Judge against row-forwards spent: the mean over seeds at before / half-way / end, the spread as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, before = summary["row_forward_flops"], summary["before"]["judge"]
    by_label: dict[str, list[dict]] = {}
    for r in summary["results"]:
        by_label.setdefault(r["label"], []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, runs in by_label.items():
        xs, ys, es = [0.0], [before], [0.0]
        for k in range(len(runs[0]["points"])):
            pts = [r["points"][k] for r in runs]
            m, s = _mean_std([p["judge"] for p in pts])
            xs.append(_mean_std([p["flops"] / unit for p in pts])[0])
            ys.append(m)
            es.append(s)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label, lw=2 if label == BASELINE else 1)
    ax.set_xlabel("DiT row-forwards spent (FLOPs / one digit's forward)")
    ax.set_ylabel("held-out judge (SVC), mean over seeds")
    ax.set_title("Digits: held-out judge vs compute, every algorithm at one budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 seed, 2 base steps, 2 pretraining steps")
    p.add_argument("--base-steps", type=int, default=6, help="the budget: this many FlowGRPO (SDE) RL steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--pretrained", help="a pretrained checkpoint folder (the demo's DIR/pretrained); default: pretrain")
    p.add_argument("--pretrain-steps", type=int, default=None, help="default: the demo's (2 with --smoke)")
    p.add_argument("--out", default="runs/bench_algorithms", help="run folders, results.json and the markdown table")
    p.add_argument("--plot", default=None, help="the PNG (default bench/algorithms_judge_vs_forwards.png; "
                                                "--smoke: OUT/judge_vs_forwards.png)")
    args = p.parse_args(argv)
    from megatron_omni.demo import PRETRAIN_STEPS

    if args.smoke:
        args.base_steps, args.seeds = 2, args.seeds[:1]
    if args.pretrain_steps is None:
        args.pretrain_steps = 2 if args.smoke else PRETRAIN_STEPS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary = Bench(args).run()
    summary["wall_s"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = table(summary)
    (out / "table").with_suffix(".md").write_text(text)  # (the markdown table)
    plot_path = Path(args.plot) if args.plot else (out / "judge_vs_forwards.png" if args.smoke else
                                                   ROOT / "bench" / "algorithms_judge_vs_forwards.png")
    plot(summary, plot_path)
    print(text + f"\nwall {summary['wall_s']:.0f} s; plot {plot_path}; results {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
