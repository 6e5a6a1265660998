"""Module-level functions the weight-sync tests run in other processes: engine factories and the
TP=2 trainer.  Engines start from their own random init, so only a working sync makes them equal."""
from __future__ import annotations

import os
import time
from functools import partial

import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.rollout.engine import EmbeddedEngine
from megatron_omni.sync import HFExporter, RemoteEngines, StageSender, SyncError, push_weights
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel

ARCH = tiny_config()
LORA = dict(rank=4, alpha=8.0)
TIMEOUT_S = 8.0  # sync-group timeout: how long a dead peer may keep the others waiting


class DyingEngine(EmbeddedEngine):
    """Exits the process in the middle of a sync (after 3 tensors) once ``die_file`` exists."""

    die_file: str | None = None

    def load_weights(self, weights):
        if self.die_file and os.path.exists(self.die_file):
            for i, _ in enumerate(weights):
                if i == 3:
                    os._exit(17)
        return super().load_weights(weights)


def make_engine(index: int, seed: int = 100, lora: bool = False, die_file: str | None = None) -> EmbeddedEngine:
    from megatron_omni.parallel.state import init_parallel

    state = init_parallel(seed=seed + index, device="cpu")  # a world of one for the engine's TP=1 model
    model = QwenImageModel(ARCH, ARCH.transformer_config(1), state.tp_group)
    if lora:
        apply_lora(model, LORA["rank"], LORA["alpha"], FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=seed + index)
    engine = DyingEngine(model, ARCH)
    engine.die_file = die_file if index == 1 else None
    return engine


def trainer_model(tp_group, tp_rank: int, tp_size: int, lora: bool = True) -> QwenImageModel:
    """The tiny model at this TP size, with LoRA adapters whose B is non-zero (merged != base)."""
    torch.manual_seed(1)
    model = QwenImageModel(ARCH, ARCH.transformer_config(tp_size), tp_group)
    if lora:
        apply_lora(model, LORA["rank"], LORA["alpha"], FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=3)
        for name, m in lora_modules(model).items():
            g = torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name)))
            full = torch.randn(m.lora_B.shape[0], m.lora_B.shape[1] * (tp_size if m.kind == "column" else 1),
                               m.lora_B.shape[2], generator=g)
            with torch.no_grad():
                m.lora_B.copy_(full.chunk(tp_size, 1)[tp_rank] if m.kind == "column" else full)
    return model


class WrongShape:
    """An exporter whose first tensor is sent one row short: the engines must refuse the sync."""

    def __init__(self, exporter):
        self.inner, self.mode = exporter, exporter.mode

    def plan(self):
        plan = self.inner.plan()
        m = plan[0]
        return [type(m)(m.name, (m.shape[0] - 1, *m.shape[1:]), m.dtype)] + plan[1:]

    def tensors(self):
        for i, (name, t) in enumerate(self.inner.tensors()):
            yield name, (t[:-1] if i == 0 else t)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tp2_trainer(state, die_file: str) -> dict:
    """Trainer at TP=2 (rank 0 sends) -> two engine processes over a gloo sync group."""
    model = trainer_model(state.tp_group, state.tp_rank, state.tp)
    engines = RemoteEngines.spawn(partial(make_engine, die_file=die_file), n=2, timeout_s=TIMEOUT_S) \
        if state.tp_rank == 0 else None
    out = {}

    def export(mode, bucket):
        return HFExporter(model, state.tp_group, mode=mode, bucket_bytes=bucket)

    def case(name, mode, bucket, checksum=True):
        ref = {n: t.clone() for n, t in export(mode, 1 << 20).tensors()}  # collective over TP
        t0 = time.perf_counter()
        stats = push_weights(engines, export(mode, bucket), bucket, checksum)
        out[name] = {"seconds": time.perf_counter() - t0, **stats}
        if engines is not None:
            out[name]["equal"] = [_same(h, ref) for h in engines.held("full")]
            out[name]["largest"] = max(t.numel() * t.element_size() for t in ref.values())

    case("merged_1MiB", "merged", 1 << 20)
    case("merged_16KiB", "merged", 16 << 10)  # smaller than most tensors: chunked across buckets
    case("full_64KiB", "full", 64 << 10, checksum=False)
    # a wrong shape is refused before any byte moves; the engines keep the previous (full) weights
    before = engines.held("full") if engines is not None else None
    try:
        exp = export("full", 64 << 10)
        push_weights(engines, WrongShape(exp) if engines is not None else exp, 64 << 10)
        out["wrong_shape"] = "accepted"
    except SyncError as e:
        out["wrong_shape"] = str(e)
    if engines is not None:
        out["unchanged"] = [_same(a, b) for a, b in zip(engines.held("full"), before)]
        open(die_file, "w").close()  # engine 1 now dies in the middle of the next sync
    t0 = time.perf_counter()
    try:
        push_weights(engines, export("merged", 16 << 10), 16 << 10)
        out["killed"] = "no error"
    except SyncError as e:
        out["killed"] = str(e)
    out["killed_seconds"] = time.perf_counter() - t0
    if engines is not None:
        engines.close()
    out["pp2"] = two_stage_senders(state)
    return out


def two_stage_senders(state) -> dict:
    """Pipeline-parallel export, simulated on the committed model: rank s keeps block s (stage 0 the input
    embedders, stage 1 the output head, both the timestep embedder) and sends it as sync rank s."""
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(2)]  # TP=1 within each stage
    pp_group = dist.new_group([0, 1])
    model = trainer_model(groups[state.rank], 0, 1)
    ref = {n: t.clone() for n, t in HFExporter(model, groups[state.rank], mode="merged").tensors()}
    for name in [n for n, _ in model.blocks.named_children() if int(n) != state.rank]:
        del model.blocks._modules[name]
    for name in (("norm_out_linear", "proj_out") if state.rank == 0 else ("txt_norm", "txt_in", "img_in")):
        delattr(model, name)
    exporter = HFExporter(model, groups[state.rank], pp_group, mode="merged", bucket_bytes=16 << 10)
    engines = RemoteEngines.spawn(make_engine, n=2, timeout_s=TIMEOUT_S, n_senders=2) if state.rank == 0 else None
    box = [engines.address if engines is not None else None]
    dist.broadcast_object_list(box, src=0)
    sender = engines if state.rank == 0 else StageSender(box[0], 1, 2, 2, timeout_s=TIMEOUT_S)
    out = {"stats": push_weights(sender, exporter, 16 << 10, checksum=True), "plan": [m.name for m in exporter.plan()]}
    if engines is not None:
        out["equal"] = [_same(h, ref) for h in engines.held("full")]
        out["all"] = sorted(ref)
    sender.close()
    return out
