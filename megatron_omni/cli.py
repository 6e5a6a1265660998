"""``megatron-omni``: the command line of the project.

    megatron-omni train --recipe qwen_image_tiny [--config run.yaml] [--print-config] [a.b=c ...]
    megatron-omni convert {hf-to-mcore,mcore-to-hf} ...   (checkpoints_convert.cli)
    megatron-omni demo [...]                              (megatron_omni.demo: the main job)
    megatron-omni generate --model DIR --prompts FILE --out DIR   (megatron_omni.generate)
    megatron-omni bench --recipe NAME [--steps 3] [--warmup 2] [--json FILE] [a.b=c ...]   (megatron_omni.bench)

``convert``, ``demo``, ``export``, ``generate`` and ``bench`` hand their arguments, ``--help`` included, to the module
that implements them; it is imported only then, so the other subcommands do not pay for its imports.
"""
import argparse
import importlib
import sys
from typing import Optional, Sequence

from megatron_omni.config import ConfigError, config_to_yaml, load_config, recipe_names

PROG = "megatron-omni"
EXIT_USAGE = 2  # argparse's code for a command line that cannot run: a bad config

# subcommand -> module whose main(argv) -> int receives the rest of the command line
FORWARDED = {"convert": "checkpoints_convert.cli", "demo": "megatron_omni.demo", "export": "megatron_omni.export",
             "generate": "megatron_omni.generate", "bench": "megatron_omni.bench"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        return _forward(argv[0], argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) and usage errors (2): return the code instead of exiting
        return _exit_code(e)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="RL post-training for diffusion transformers on megatron-core.",
        epilog=f"Run `{PROG} COMMAND --help` for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    # Listed here for the help text only: main() forwards these before argparse runs.
    sub.add_parser("convert", add_help=False, help="convert checkpoints HF diffusers <-> megatron-core "
                   "(hf-to-mcore --hf DIR --out DIR --tp N [--pp N] | mcore-to-hf --mcore DIR --out DIR)")
    sub.add_parser("demo", add_help=False, help="run the demo job (tiny Qwen-Image on this machine)")
    sub.add_parser("export", add_help=False, help="export a training checkpoint for diffusers "
                   "(--checkpoint DIR --out DIR [--merged] [--step N]: a LoRA folder, or a merged transformer folder)")
    sub.add_parser("generate", add_help=False, help="sample one PNG per prompt line from a pipeline folder, "
                   "optionally with a LoRA folder or a checkpoint (--model DIR --prompts FILE --out DIR [--lora DIR | "
                   "--checkpoint DIR]; torchrun: data parallel)")
    sub.add_parser("bench", add_help=False, help="time a run config's RL step as train runs it: the loop's phases, the "
                   "DiT side and end to end, images/s, TFLOP/s and MFU (--recipe NAME [--steps 3] [--warmup 2] "
                   "[--json FILE] [KEY=VALUE ...])")
    return parser


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="FlowGRPO post-training run (torchrun launches one process per rank)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Resolve and validate a run config (the recipe, then the YAML file, then the\n"
                    "KEY=VALUE overrides; later wins), then run the FlowGRPO loop into train.output_dir:\n"
                    "metrics.jsonl, checkpoints/, sample grids, reward_curve.png, wandb/ (offline).",
        epilog="example:\n  megatron-omni train --recipe qwen_image_tiny --print-config \\\n"
               "      parallel.tp=2 model.arch.num_layers=4 'model.arch.axes_dims_rope=[8,8,16]' train.lr=1e-4\n"
               "  megatron-omni train --recipe digits_flow_grpo train.steps=20 train.output_dir=runs/digits")
    p.add_argument("--recipe", choices=recipe_names(), help="named recipe to start from")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file merged on top of the recipe; "
                   "checked against the same dataclasses (unknown keys are errors)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit 0")
    p.add_argument("--resume", action="store_true", help="continue from train.output_dir's latest checkpoint")
    p.add_argument("--estimate-memory", action="store_true",
                   help="print the per-device memory estimate of the config's layout and exit (2 when it does not "
                        "fit --device-memory); a run on a GPU checks it before building anything")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="ranks for --estimate-memory (default: tp x cp x pp, one data-parallel replica)")
    p.add_argument("--device-memory", type=float, metavar="GIB", help="device memory for --estimate-memory, GiB")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. parallel.tp=2 model.arch.num_layers=4 train.lr=1e-4")
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    if args.recipe is None and args.config is None:
        _error("train", "give --recipe NAME and/or --config FILE.yaml "
                        f"(recipes: {', '.join(recipe_names())})")
        return EXIT_USAGE
    try:
        cfg = load_config(args.recipe, args.config, args.overrides)
    except ConfigError as e:
        _error("train", str(e))
        return EXIT_USAGE
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    if args.estimate_memory:
        return _estimate_memory(cfg, args)
    from megatron_omni.trainer.preemption import EXIT_PREEMPTED, Preempted
    from megatron_omni.trainer.run import run_training

    try:
        run_training(cfg, resume=args.resume)
    except ValueError as e:  # a config that validates alone but does not fit its task (channels, text width)
        _error("train", str(e))
        return EXIT_USAGE
    except Preempted as e:  # SIGUSR1 / SIGTERM: checkpointed at a step boundary; the launcher requeues
        print(f"{PROG} train: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


def _estimate_memory(cfg, args: argparse.Namespace) -> int:
    from megatron_omni.trainer.memory import GIB, check_fits, estimate

    p = cfg.parallel
    world = args.world_size or p.tp * p.cp * p.pp
    device = args.device_memory * GIB if args.device_memory else None
    try:
        est = estimate(cfg, world, device_bytes=device)  # (the device resolves rollout.engine_parallel=auto)
        if device:
            check_fits(est, device)
    except ValueError as e:
        _error("train", str(e))
        return EXIT_USAGE
    print(est.table(device))
    return 0


def _forward(command: str, argv: list[str]) -> int:
    module_name = FORWARDED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # a missing optional dependency, or a checkout without the module
        _error(command, f"cannot import {module_name}: {e}")
        return 1
    try:
        return int(module.main(argv) or 0)
    except SystemExit as e:  # its argparse exits on --help and on usage errors
        return _exit_code(e)


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # sys.exit("message") convention
    return 1


def _error(command: str, message: str) -> None:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
