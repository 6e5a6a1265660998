"""Module-level functions the weight-sync tests run in other processes: engine factories, the TP=2
trainer and the real pipeline-parallel trainer.  Engines start from their own random init, so only a
working sync makes them equal."""
from __future__ import annotations

import os
import time
from functools import partial

import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.rollout.engine import EmbeddedEngine
from megatron_omni.sync import HFExporter, Rank0Engine, RemoteEngines, StageSender, SyncError, push_weights
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.qwen_image.config import tiny_config
from model_specs.qwen_image.model import QwenImageModel

ARCH = tiny_config()
LORA = dict(rank=4, alpha=8.0)
TIMEOUT_S = 8.0  # sync-group timeout: how long a dead peer may keep the others waiting


class DyingEngine(EmbeddedEngine):
    """Exits the process in the middle of a sync (after 3 tensors) once ``die_file`` exists, removing
    the file first: it dies once, and an engine started again syncs normally."""

    die_file: str | None = None

    def load_weights(self, weights):
        if self.die_file and os.path.exists(self.die_file):
            for i, _ in enumerate(weights):
                if i == 3:
                    os.remove(self.die_file)
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
        add_adapters(model, tp_rank, tp_size)
    return model


def add_adapters(model: QwenImageModel, tp_rank: int, tp_size: int) -> None:
    """LoRA adapters with a non-zero B drawn per module name over the whole (global) shape: the same
    adapters at every TP and PP layout."""
    apply_lora(model, LORA["rank"], LORA["alpha"], FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=3)
    for name, m in lora_modules(model).items():
        g = torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name)))
        full = torch.randn(m.lora_B.shape[0], m.lora_B.shape[1] * (tp_size if m.kind == "column" else 1),
                           m.lora_B.shape[2], generator=g)
        with torch.no_grad():
            m.lora_B.copy_(full.chunk(tp_size, 1)[tp_rank] if m.kind == "column" else full)


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

    def case(name, mode, bucket, checksum=True, engines=engines):
        ref = {n: t.clone() for n, t in export(mode, 1 << 20).tensors()}  # collective over TP
        t0 = time.perf_counter()
        stats = push_weights(engines, export(mode, bucket), bucket, checksum)
        out[name] = {"seconds": time.perf_counter() - t0, **stats}
        remote = engines.engines if isinstance(engines, Rank0Engine) else engines
        if remote is not None:
            out[name]["equal"] = [_same(h, ref) for h in remote.held("full")]
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
    # every trainer rank sees rank 0's failure (Rank0Engine), so all of them restart and sync again together
    both = Rank0Engine(engines, state.tp_group)
    t0 = time.perf_counter()
    try:
        push_weights(both, export("merged", 16 << 10), 16 << 10)
        out["killed"] = "no error"
    except SyncError as e:
        out["killed"] = str(e)
    out["killed_seconds"] = time.perf_counter() - t0
    both.restart()  # engine 1 removed its die_file: it dies once
    case("restarted", "merged", 16 << 10, engines=both)
    both.close()
    return out


# ---- the real pipeline-parallel trainer -------------------------------------------------------------------

PP_LAYOUTS = ((1, 2), (2, 2))  # (tp, pp) on 4 ranks; at tp=1 the second data-parallel replica sits out


def pp_trainer(ref_hf: dict) -> dict:
    """Both layouts in one launch.  Stage 0's sender (TP rank 0 of replica 0) drives two engine processes
    (``RemoteEngines``), stage 1's joins them (``StageSender``); the same two processes send at both
    layouts, so the engines and the sync group are set up once."""
    from megatron_omni.parallel.state import destroy_parallel, init_parallel

    out, link, link_stage = {}, None, None
    for tp, pp in PP_LAYOUTS:
        state = init_parallel(tp=tp, pp=pp, seed=0, device="cpu")
        if state.dp_rank == 0:
            sender = state.tp_rank == 0
            if sender and link is None:
                link, link_stage = _pp_link(state), state.pp_rank
            if sender and link_stage != state.pp_rank:
                raise RuntimeError(f"rank {state.rank} sends for stage {link_stage}, now is on stage {state.pp_rank}")
            out[(tp, pp)] = _pp_cases(state, ref_hf, link if sender else None, restart=(tp, pp) == PP_LAYOUTS[-1])
        destroy_parallel(keep_default_group=True)
    if link is not None:
        link.close()
    torch.distributed.destroy_process_group()
    return out


def _pp_link(state):
    """Stage 0 spawns the engines; their address reaches stage 1 over the trainer's pipeline group."""
    import torch.distributed as dist

    engines = RemoteEngines.spawn(make_engine, n=2, timeout_s=TIMEOUT_S, n_senders=2) if state.pp_rank == 0 else None
    box = [engines.address if engines is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(state.pp_group, 0), group=state.pp_group)
    return engines if engines is not None else StageSender(box[0], 1, 2, 2, timeout_s=TIMEOUT_S)


def pp_stage_model(state, ref_hf: dict) -> QwenImageModel:
    """This rank's pipeline stage, built as the trainer builds it (only its blocks), loaded with the HF
    reference weights through the mapping table, with the adapters of ``add_adapters``."""
    from checkpoints_convert.convert import mcore_state_from_hf
    from megatron_omni.trainer.policy import build_chunks, policy_transformer_config

    (model,) = build_chunks(ARCH, state, policy_transformer_config(ARCH, state, torch.float32))
    own = model.state_dict()
    wanted = {k: v for k, v in mcore_state_from_hf(ARCH, ref_hf.__getitem__, state.tp_rank, state.tp).items()
              if k in own}
    missing = model.load_state_dict(wanted, strict=False).missing_keys
    if [k for k in missing if not k.endswith("_extra_state")]:
        raise RuntimeError(f"stage {state.pp_rank} has tensors the HF reference does not: {missing}")
    add_adapters(model, state.tp_rank, state.tp)
    return model


def merged_reference(ref_hf: dict, adapters: dict) -> dict:
    """W + (alpha / r) B A per adapted HF module, from the HF weights and the peft-named adapters."""
    out = dict(ref_hf)
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            delta = (adapters[f"{module}.lora_B.weight"] @ a) * (LORA["alpha"] / LORA["rank"])
            out[f"{module}.weight"] = ref_hf[f"{module}.weight"] + delta
    return out


def differing(held: dict, ref: dict, rtol: float = 0.0) -> list[str]:
    """Names missing on one side or not bit-equal; with ``rtol``, not within ``rtol`` of the tensor's largest
    magnitude (for a reference computed otherwise than what was sent, see ``_pp_cases``)."""
    def same(a, b):
        if rtol == 0.0:
            return torch.equal(a, b)
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0.0, atol=rtol * b.abs().max())

    unequal = {n for n in held.keys() & ref.keys() if not same(held[n], ref[n])}
    return sorted((held.keys() ^ ref.keys()) | unequal)


# merged weights at TP=2: the trainer forms (alpha / r) B A per shard (B split by rows for a column-parallel linear,
# A by columns for a row-parallel one), the reference over the whole matrices: float32 GEMMs of another shape (K = 4),
# so a product can round to the neighbouring float (~1e-7 of |W|).  1e-6 of the largest entry; a bucket chunk
# written at the wrong offset, q / k / v swapped, an adapter missing or a bf16 wire moves entries by >= 1e-3 of it.
# The full weights, and merged ones at TP=1 (the same GEMMs as the reference's), stay bit for bit.
MERGED_TP_RTOL = 1e-6


def _restart_link(state, link) -> None:
    """The engines started again (as after a failed sync): a new group, whose address stage 1 is sent."""
    import torch.distributed as dist

    if state.pp_rank == 0:
        link.restart()
    box = [link.address if state.pp_rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(state.pp_group, 0), group=state.pp_group)
    if state.pp_rank == 1:
        link.reconnect(box[0])


def _pp_cases(state, ref_hf: dict, sender, restart: bool = False) -> dict:
    """full (64 KiB buckets), merged (16 KiB: smaller than the largest tensor), a wrong shape in stage 1's
    plan, and with ``restart`` a full sync to restarted engines; every sync with checksums.  Rank 0
    compares what the engines hold with the references."""
    import torch.distributed as dist

    from model_specs.common.lora import peft_state_dict

    model = pp_stage_model(state, ref_hf)
    stages = [None] * state.pp
    dist.all_gather_object(stages, peft_state_dict(model), group=state.pp_group)  # peft_state_dict: TP collective
    refs = {"full": ref_hf, "merged": merged_reference(ref_hf, {k: v for s in stages for k, v in s.items()})}
    engines = sender if state.rank == 0 else None
    out = {"before": [differing(h, ref_hf) != [] for h in engines.held("full")] if engines else None}

    def push(mode, bucket, wrong=False):
        exporter = HFExporter(model, state.tp_group, state.pp_group, mode=mode, bucket_bytes=bucket)
        out.setdefault("plan", {})[mode] = [m.name for m in exporter.plan()]
        wrap = wrong and sender is not None and state.pp_rank == 1
        return push_weights(sender, WrongShape(exporter) if wrap else exporter, bucket, checksum=True)

    rtol = {"full": 0.0, "merged": MERGED_TP_RTOL if state.tp > 1 else 0.0}
    for mode, bucket in (("full", 64 << 10), ("merged", 16 << 10)):
        out[mode] = push(mode, bucket)
        if engines is not None:
            out[mode]["differing"] = [differing(h, refs[mode], rtol[mode]) for h in engines.held("full")]
            out[mode]["largest"] = max(t.numel() * t.element_size() for t in refs[mode].values())
    try:
        push("full", 64 << 10, wrong=True)
        out["wrong_shape"] = "accepted"
    except SyncError as e:
        out["wrong_shape"] = str(e)
    if engines is not None:  # still the merged weights of the sync before
        out["unchanged"] = [differing(h, refs["merged"], rtol["merged"]) for h in engines.held("full")]
        out["adapted"] = len(differing(refs["merged"], ref_hf))  # tensors the merge changed
    if restart:
        if sender is not None:
            _restart_link(state, sender)
        out["restarted"] = {"before": [differing(h, ref_hf) != [] for h in engines.held("full")] if engines else None}
        out["restarted"].update(push("full", 64 << 10))
        if engines is not None:
            out["restarted"]["differing"] = [differing(h, ref_hf) for h in engines.held("full")]
    return out
