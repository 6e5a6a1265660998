"""`megatron-omni demo` (`make demo`): a small, real FlowGRPO run on the CPU of a fresh machine.

1. pretrain a tiny Qwen-Image-architecture model (our Megatron specs) by flow matching on
   scikit-learn's handwritten digits (16x16 pixels packed 2x2), conditioned on MiniLM prompts
   ("a handwritten digit seven");
2. measure the training reward (a digit CNN) and a held-out judge (an SVC) on fixed evaluation seeds;
3. post-train with FlowGRPO against the CNN reward (recipe ``digits_flow_grpo``);
4. measure again; print the before/after table; write ``summary.json`` in the run folder.

``megatron-omni demo convert`` runs the checkpoint-conversion job instead (``demo_convert.py``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from checkpoints_convert.mcore_checkpoint import save_model
from megatron_omni.config import load_config
from megatron_omni.data.digits import load_digit_images, pack_2x2
from megatron_omni.data.tasks import Task, build_task
from megatron_omni.parallel.state import init_parallel
from megatron_omni.rewards import build_reward
from megatron_omni.rollout.engine import EmbeddedEngine, Request
from megatron_omni.trainer.build import export_hf
from megatron_omni.trainer.loop import train
from megatron_omni.trainer.policy import build_policy
from megatron_omni.trainer.pretrain import pretrain

EVAL_SEEDS = 8  # evaluation samples per digit, fixed seeds (same before and after RL)
# A deliberately short pretraining: a base model that draws digits, but often the wrong one or a
# blurred one, so that RL has room to improve and the judge can show whether the gain is real.
PRETRAIN_STEPS = 80


def evaluate(policy, task: Task, cfg, judges: dict) -> dict[str, float]:
    """Mean reward and judge over 10 digits x EVAL_SEEDS fixed seeds, sampled as in training (SDE)."""
    family, arch = cfg.model.family_impl, cfg.model.arch
    model = family.build(arch, family.transformer_config(arch, 1, perform_initialization=False), policy.state.tp_group)
    engine = EmbeddedEngine(model, arch, task.encode, cfg.rollout)
    engine.load_weights(export_hf(policy))
    r = cfg.rollout
    requests = [Request(prompt=p, seed=10_000 + 97 * d + i, img_fhw=task.img_fhw, num_steps=r.num_steps,
                        shift=r.shift, sampler=r.sampler, noise_level=r.noise_level, guidance_scale=r.guidance_scale)
                for d, p in enumerate(task.prompts) for i in range(EVAL_SEEDS)]
    trajs = engine.generate(requests)
    images = task.decode(torch.stack([t.final_sample for t in trajs]))
    prompts = [t.request.prompt for t in trajs]
    return {name: float(fn(images, prompts, None).mean()) for name, fn in judges.items()}


def _pretrain(cfg, state, task: Task, out: Path, steps: int) -> tuple:
    policy = build_policy(cfg.model.arch, state, lr=1e-3, clip_grad=1.0)
    x, labels = load_digit_images()
    emb, mask = task.encode(task.prompts + [""])
    losses = pretrain(policy, pack_2x2(x), emb[labels], mask[labels], task.img_fhw, steps=steps, batch_size=64,
                      seed=cfg.train.seed, uncond=(emb[-1], mask[-1]))
    family = cfg.model.family_impl
    save_model(policy.module, out / "pretrained", {"family": family.name, "arch": family.arch_to_config(cfg.model.arch),
                                                  "tp": 1, "pp": 1, "dtype": cfg.model.dtype})
    return policy, losses


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv[:1] == ["convert"]:
        from megatron_omni.demo_convert import main as convert_main

        return convert_main(argv[1:])
    p = argparse.ArgumentParser(prog="megatron-omni demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo", help="run folder (replaced unless --resume; default runs/demo)")
    p.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS,
                   help=f"flow-matching steps of batch 64 before RL (default {PRETRAIN_STEPS})")
    p.add_argument("--resume", action="store_true", help="continue the RL phase from the run folder's checkpoint")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of recipe digits_flow_grpo")
    args = p.parse_args(argv)
    start, out = time.perf_counter(), Path(args.out)
    cfg = load_config("digits_flow_grpo", None, args.overrides)
    if not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    state = init_parallel(seed=cfg.train.seed, device=cfg.parallel.device)
    task = build_task(cfg.data.task, cfg.data.text_max_tokens)
    judges = {"reward": build_reward(cfg.reward.name), "judge": build_reward(cfg.reward.judge)}

    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if args.resume and summary_path.exists() else {}
    if "reward_before" not in summary:
        print(f"[1/3] pretraining by flow matching for {args.pretrain_steps} steps ...", flush=True)
        policy, losses = _pretrain(cfg, state, task, out, args.pretrain_steps)
        before = evaluate(policy, task, cfg, judges)
        summary = {"pretrain_steps": len(losses), "pretrain_loss_last": sum(losses[-10:]) / min(10, len(losses)),
                   "reward_before": before["reward"], "judge_before": before["judge"]}
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"      {len(losses)} steps, loss {summary['pretrain_loss_last']:.3f}; reward {before['reward']:.3f}, "
              f"judge {before['judge']:.3f}", flush=True)

    print(f"[2/3] FlowGRPO for {cfg.train.steps} steps ...", flush=True)
    cfg.model.mcore_path = str(out / "pretrained")
    run, _ = train(cfg, state, task, out, resume=args.resume)

    print("[3/3] evaluating ...", flush=True)
    after = evaluate(run.policy, task, cfg, judges)
    summary.update(reward_after=after["reward"], judge_after=after["judge"],
                   wall_seconds=round(time.perf_counter() - start, 1) + summary.get("wall_seconds", 0.0))
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    _print_table(summary, out)
    return 0


def _print_table(summary: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="FlowGRPO on handwritten digits (tiny Qwen-Image, CPU)")
    for col in ("", "before RL", "after RL", "change"):
        table.add_column(col, justify="right")
    for key, label in (("reward", "reward (digit CNN, trained on)"), ("judge", "judge (SVC, held out)")):
        b, a = summary[f"{key}_before"], summary[f"{key}_after"]
        table.add_row(label, f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}")
    console = Console()
    console.print(table)
    console.print(f"wall time {summary['wall_seconds']:.0f} s; run folder {out} (summary.json, metrics.jsonl, "
                  f"reward_curve.png, samples_step*.png, checkpoints/)")


if __name__ == "__main__":
    raise SystemExit(main())
