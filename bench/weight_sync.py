"""Weight-sync benchmark: seconds per sync and GB/s, trainer -> rollout engine (megatron_omni.sync).

Cases (each a fresh engine process):
  gpu2gpu    trainer on GPU 0, engine process on GPU 1, dedicated NCCL group (needs 2 GPUs;
             with --smoke: two CPU processes over gloo)
  colocated  engine process on the trainer's GPU, shared-memory (CUDA IPC) buckets opened once
  lora       colocated, LoRA r64 / alpha 128 on the 12 usual Qwen-Image linears, adapters only
Each case runs with ``--load engine`` (the engine's load: full / merged straight from the buckets into
its parameters, LoRA staged whole then committed with one fused copy) or ``--load none`` (the receiver
checks the plan against a meta-device model and drops the bytes: transport alone), or both (default).
Full-size Qwen-Image (20.43 B params, bf16, random init) unless ``--smoke``: the tiny model on the CPU
over gloo / POSIX shared memory, to check the script; ``--smoke --layers 60`` has the full model's
tensor counts (1,933 HF tensors, 1,440 adapters), so per-tensor costs show on a CPU.

    python bench/weight_sync.py --smoke
    python bench/weight_sync.py --smoke --layers 60 --cases colocated,lora
    python bench/weight_sync.py --cases gpu2gpu,colocated,lora --bucket-mb 1024 --repeats 5

One exporter per case, reused by every sync (as the trainer does); median of ``--repeats`` syncs after
one warm-up (which sends the plan in full; later syncs send its digest); GB/s counts the bytes of the
HF tensors sent.  The phase columns are described in ``_phases``.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from datetime import date
from functools import partial

import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.parallel.state import init_parallel
from megatron_omni.rollout.engine import EmbeddedEngine
from megatron_omni.sync import HFExporter, RemoteEngines, push_weights
from model_specs.common.dtypes import DTYPES
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
from model_specs.qwen_image.config import QwenImageConfig, tiny_config
from model_specs.qwen_image.model import QwenImageModel


class SinkEngine(EmbeddedEngine):
    """Receives and drops the tensors (the plan is still checked against its meta-device model)."""

    def load_weights(self, weights):
        n = 0
        for _, t in weights:
            n += t.numel()
        return set()


def _model(arch: QwenImageConfig, dtype, device, tp_group, lora_rank: int, random: bool) -> QwenImageModel:
    with torch.device(device):  # parameters are allocated where they live (meta: shapes only)
        model = QwenImageModel(arch, arch.transformer_config(1, params_dtype=dtype, perform_initialization=False),
                               tp_group)
    if random and device != "meta":
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    if lora_rank:
        apply_lora(model, lora_rank, 2.0 * lora_rank, FLOW_GRPO_TARGETS, qwen_image_rules(arch))
        if device != "meta":
            model.to(device)
    return model


def engine_factory(arch: QwenImageConfig, dtype_name: str, gpu: int | None, lora_rank: int, sink: bool,
                   index: int) -> EmbeddedEngine:
    # on a GPU, spawn() has set CUDA_VISIBLE_DEVICES to the engine's GPU: cuda:0 here is that GPU
    state = init_parallel(device="cuda" if gpu is not None else "cpu")
    device = "meta" if sink else str(state.torch_device)
    model = _model(arch, DTYPES[dtype_name], device, state.tp_group, lora_rank, random=False)
    return (SinkEngine if sink else EmbeddedEngine)(model, arch)


CASES = {"gpu2gpu": ("process", 1), "colocated": ("colocated", 0), "lora": ("colocated", 0)}  # placement, GPU


def run_case(name: str, args, arch, state, trainer_model, load: str) -> dict:
    gpu = args.device == "cuda"
    lora = args.lora_rank if name == "lora" else 0
    model = trainer_model(lora)
    placement, engine_gpu = CASES[name]
    bucket = args.bucket_mb << 20
    engines = RemoteEngines.spawn(partial(engine_factory, arch, args.dtype, engine_gpu if gpu else None, lora,
                                          load == "none"),
                                  placement=placement, backend="nccl" if gpu else "gloo", timeout_s=args.timeout_s,
                                  bucket_bytes=bucket, device=str(state.torch_device), start_timeout_s=1800,
                                  child_env={"CUDA_VISIBLE_DEVICES": str(engine_gpu)} if gpu else None)
    try:
        times, phases, stats = [], [], {}
        # one exporter for every sync, as the trainer keeps one: items, plan and sources resolved once
        exporter = HFExporter(model, state.tp_group, mode="lora" if lora else "full", bucket_bytes=bucket)
        for i in range(args.repeats + 1):
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = push_weights(engines, exporter, bucket, checksum=False)
            if gpu:
                torch.cuda.synchronize()
            if i:  # the first sync is the warm-up (allocations, NCCL connections, the plan sent in full)
                times.append(time.perf_counter() - t0)
                phases.append(_phases(stats))
        secs = statistics.median(times)
        split = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        split["export"] = _export_seconds(exporter, gpu)
        label = name if not (name == "gpu2gpu" and not gpu) else "process (gloo)"
        return {"case": label, "load": load, "GB": stats["bytes"] / 1e9, "buckets": stats["buckets"],
                "seconds": secs, "GB/s": stats["bytes"] / 1e9 / secs, "tensors": stats["tensors"], "split": split}
    finally:
        engines.close()


def _phases(stats: dict) -> dict[str, float]:
    """Where one sync's time went.  Seen from the sender: metadata (plan, or its digest, + status round),
    pack + send (export, fused packing, hand-over of the buckets, overlapped with the engine copying out
    of them), finish (the engine ending its load + checksums + status).  Seen from the engine: receiver
    load, from the end of its metadata round to the end of its load; it includes waiting for the buckets,
    so it overlaps pack + send, and its excess over pack + send is the engine's own tail (LoRA: the commit)."""
    seconds = stats.get("seconds", {})
    out = {"metadata": seconds.get("metadata", float("nan")), "pack+send": seconds.get("stream", float("nan")),
           "finish": seconds.get("finish", float("nan"))}
    engines = stats.get("engines") or [{}]
    out["receiver load"] = engines[0].get("seconds", {}).get("load", float("nan"))
    return out


def _export_seconds(exporter: HFExporter, gpu: bool, repeats: int = 3) -> float:
    """The exporter alone (gather, name, yield; nothing sent), median of ``repeats``: the part of a
    sync's "pack + send" time that is the trainer's own work."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _name, _t in exporter.tensors():
            pass
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, CPU, gloo / POSIX shared memory")
    p.add_argument("--cases", default="gpu2gpu,colocated,lora")
    p.add_argument("--load", choices=["engine", "none", "both"], default="both")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--layers", type=int, default=None,
                   help="with --smoke: blocks of the tiny model (60 gives the full model's tensor count)")
    args = p.parse_args(argv)
    if args.smoke:
        arch, args.device, args.bucket_mb, args.lora_rank = tiny_config(num_layers=args.layers or 2), "cpu", 1, 4
    else:
        arch, args.device = QwenImageConfig(), "cuda"
    state = init_parallel(device=args.device)
    dtype = DTYPES[args.dtype]
    cache = {}

    def trainer_model(lora_rank):
        if lora_rank not in cache:
            cache.clear()  # one full-size model at a time
            if args.device == "cuda":
                torch.cuda.empty_cache()
            cache[lora_rank] = _model(arch, dtype, str(state.torch_device), state.tp_group, lora_rank, random=True)
        return cache[lora_rank]

    loads = ["engine", "none"] if args.load == "both" else [args.load]
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"--cases: {name!r} is not one of {list(CASES)}")
        if name == "gpu2gpu" and not args.smoke and torch.cuda.device_count() < 2:
            print("skipping gpu2gpu: needs 2 GPUs")
            continue
        rows += [run_case(name, args, arch, state, trainer_model, load) for load in loads]
    _print(rows, args)


def _print(rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    title = (f"weight sync, {'tiny model, CPU (smoke)' if args.smoke else 'Qwen-Image 20.4 B'} {args.dtype}, "
             f"bucket {args.bucket_mb} MiB, median of {args.repeats} — {date.today()} {commit}")
    table = Table(title=title)
    phases = ("metadata", "pack+send", "receiver load", "finish", "export")
    for col in ("case", "engine load", "GB", "tensors", "buckets", "s / sync", "GB/s",
                *[f"{p if p != 'export' else 'export alone'} s" for p in phases]):
        table.add_column(col, justify="right" if col not in ("case", "engine load") else "left")
    for r in rows:
        split = [f"{r['split'][k]:.4f}" if r["split"].get(k) == r["split"].get(k) else "-" for k in phases]
        table.add_row(r["case"], r["load"], f"{r['GB']:.4f}", str(r["tensors"]), str(r["buckets"]),
                      f"{r['seconds']:.4f}", f"{r['GB/s']:.2f}", *split)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
