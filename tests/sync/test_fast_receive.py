"""The receiver's fast paths.  LoRA adapters: the whole stream is staged in one resident buffer, then
committed with one fused copy (a sync that fails midway changes nothing).  Full / merged: straight from
the buckets into the engine's parameters, q / k / v into strided views of the fused QKV; a sender killed
in the middle leaves the engine refusing to generate until a sync of the whole model succeeds.  Every
engine tensor is compared bit for bit with the trainer's HF export."""
import multiprocessing as mp
import os

import pytest
import torch

from checkpoints_convert.mapping import QKV, fuse_qkv, tp_shard, to_mcore
from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.sync import HFExporter, SharedMemoryChannel, SyncError, engine_side, send_weights, shared_buffers
from model_specs.common.lora import lora_modules, peft_state_dict
from tests.sync.fast_sync_harness import (
    FailsAfter, InProcessSync, adapters_of, bump, export, make_engine, request, same,
)
from tests.sync.workers import ARCH, trainer_model


@pytest.mark.parametrize("bucket", [4 << 10, 1 << 20])  # 4 KiB < the largest adapter (8 KiB): chunked
def test_lora_fast_path_equals_the_trainers_adapters(single_rank, bucket):
    model = trainer_model(single_rank.tp_group, 0, 1)
    link = InProcessSync(make_engine(single_rank.tp_group, lora=True))
    exporter = HFExporter(model, single_rank.tp_group, mode="lora")
    staging = []
    for _ in range(3):
        assert not same(engine_side.held(link.engine, "lora"), peft_state_dict(model))
        link.sync(exporter, bucket, checksum=True)
        assert same(engine_side.held(link.engine, "lora"), peft_state_dict(model))
        staging.append(engine_side._state(link.engine).staging.data_ptr())
        bump(model)
    assert len(set(staging)) == 1  # the staging buffer is allocated once and reused


def test_lora_sync_failing_midway_changes_nothing(single_rank):
    model = trainer_model(single_rank.tp_group, 0, 1)
    link = InProcessSync(make_engine(single_rank.tp_group, lora=True), timeout_s=2.0)
    exporter = HFExporter(model, single_rank.tp_group, mode="lora")
    link.sync(exporter, 4 << 10)
    before = adapters_of(link.engine.model)
    bump(model)
    with pytest.raises(RuntimeError, match="trainer crashed mid-sync"):
        link.sync(FailsAfter(exporter, 20), 4 << 10)  # some buckets went, the rest never comes
    assert isinstance(link.received[-1], SyncError)
    assert same(adapters_of(link.engine.model), before)
    link.engine.generate([request()])  # nothing was half-written: the engine still serves


@pytest.mark.parametrize("mode", ["full", "merged"])
def test_direct_load_equals_the_export_including_the_fused_qkv(single_rank, mode):
    model = trainer_model(single_rank.tp_group, 0, 1)
    link = InProcessSync(make_engine(single_rank.tp_group))
    exporter = HFExporter(model, single_rank.tp_group, mode=mode)
    for bucket in (16 << 10, 64 << 10, 1 << 20):  # 16 KiB < most tensors: chunked across buckets
        bump(model)
        link.sync(exporter, bucket, checksum=True)
        sent = export(exporter)
        assert same(engine_side.held(link.engine, "full"), sent)
        params = dict(link.engine.model.named_parameters())
        qkv_rules = [r for r in qwen_image_rules(ARCH) if r.transform == QKV]
        for rule in qkv_rules:  # q / k / v per head interleaved
            fused = fuse_qkv(*(sent[h] for h in rule.hf), heads=ARCH.num_attention_heads)
            assert torch.equal(params[rule.mcore], fused), rule.mcore
        # q, k, v side by side in one bucket went in one strided copy: 2 copies fewer per such fused QKV
        plan, stream = engine_side._state(link.engine).prepared[1], link.rx.plans.known[0]
        inside = {i for idx in plan.inside[0].values() for i in idx}
        trios = [i for i in plan.stacked[0] if {i, i + 1, i + 2} <= inside and
                 (stream.entries[i].offset // bucket) == (stream.entries[i + 2].offset // bucket)]
        copies = sum(len(d) for _, groups in plan._copies.values() for d, _ in groups)
        assert len(plan.stacked[0]) == len(qkv_rules) and copies == len(inside) - 2 * len(trios)
        assert trios or bucket == 16 << 10


# ---- the engine at TP=2: each rank receives the whole tensors and keeps its shards --------------------------

def _tp2_engine_receives_its_shards(state) -> dict:
    import torch.distributed as dist

    solo = [dist.new_group([r]) for r in range(2)][state.rank]
    model = trainer_model(solo, 0, 1)  # the trainer at TP=1, the same on both ranks (a sender per rank)
    links = {lora: InProcessSync(make_engine(state.tp_group, lora=lora, tp_rank=state.tp_rank, tp_size=state.tp))
             for lora in (False, True)}
    out = {}
    for mode, bucket in (("full", 16 << 10), ("lora", 4 << 10), ("full", 1 << 20), ("lora", 1 << 20)):
        bump(model)
        link = links[mode == "lora"]
        link.sync(HFExporter(model, solo, mode=mode), bucket)
        engine = link.engine
        if mode == "full":
            sent, params = export(HFExporter(model, solo, mode="full")), dict(engine.model.named_parameters())
            out[f"full_{bucket}"] = all(
                torch.equal(params[r.mcore], tp_shard(to_mcore(r, sent.__getitem__, ARCH.num_attention_heads),
                                                      r.tp_dim, state.tp_rank, state.tp))
                for r in qwen_image_rules(ARCH))
        else:
            sent, held = peft_state_dict(model), {}
            for m in lora_modules(engine.model).values():
                for name, t, dim in m.peft_tensors():
                    held[name] = torch.equal(t, tp_shard(sent[name], dim, m.tp_rank, m.tp_size))
            out[f"lora_{bucket}"] = all(held.values()) and len(held) == len(sent)
    return out


def test_an_engine_at_tp2_keeps_its_shards():
    for out in run_distributed(_tp2_engine_receives_its_shards, 2, parallel={"tp": 2}, timeout_s=240):
        assert out == {"full_16384": True, "lora_4096": True, "full_1048576": True, "lora_1048576": True}, out


# ---- a sender killed in the middle of a direct load ---------------------------------------------------------

def _sender(conn, buffers, die_after: int | None) -> None:
    """A trainer in its own process: one full sync over the colocated channel; with ``die_after`` the
    process exits (as if killed) after that many tensors, in the middle of the stream."""
    from megatron_omni.parallel.state import init_parallel

    state = init_parallel(device="cpu")
    torch.set_num_threads(1)
    model = trainer_model(state.tp_group, 0, 1)
    if die_after is not None:
        bump(model)
    exporter = HFExporter(model, state.tp_group, mode="full")
    channel = SharedMemoryChannel(conn, buffers, rank=0, timeout_s=30)

    def tensors():
        for i, pair in enumerate(exporter.tensors()):
            if i == die_after:
                os._exit(9)
            yield pair

    send_weights(channel, 0, 1, exporter.plan(), tensors(), 16 << 10, "full")


def _sync_from_a_process(engine, die_after: int | None):
    ctx = mp.get_context("spawn")
    buffers = shared_buffers(1 << 20)
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(theirs, buffers, die_after), daemon=True)
    proc.start()
    theirs.close()  # the sender's end lives in its process only: its death closes the pipe (EOF here)
    link = InProcessSync(engine)
    link.rx = SharedMemoryChannel(ours, buffers, rank=1, timeout_s=30)
    link._receive()
    proc.join(timeout=60)
    return link.received[-1]


def test_a_sender_killed_mid_stream_leaves_the_engine_refusing_until_a_good_sync(single_rank):
    engine = make_engine(single_rank.tp_group)
    assert not isinstance(_sync_from_a_process(engine, None), SyncError)
    good = engine_side.held(engine, "full")
    engine.generate([request()])
    # the sender dies after 40 tensors: the buckets before it are already in the engine's parameters
    error = _sync_from_a_process(engine, 40)
    assert isinstance(error, SyncError) and "the peer process is gone" in str(error)
    assert not same(engine_side.held(engine, "full"), good)  # part new: a half-written model ...
    with pytest.raises(RuntimeError, match=r"weights are incomplete: weight sync 2 \(full, plan [0-9a-f]{12}\) "
                                           r"failed after writing part of them"):
        engine.generate([request()])  # ... that refuses to generate, naming the failed sync
    assert not isinstance(_sync_from_a_process(engine, None), SyncError)
    assert same(engine_side.held(engine, "full"), good)
    engine.generate([request()])


def test_a_wrong_shape_leaves_the_directly_loaded_engine_unchanged(single_rank):
    from tests.sync.workers import WrongShape

    model = trainer_model(single_rank.tp_group, 0, 1)
    link = InProcessSync(make_engine(single_rank.tp_group))
    exporter = HFExporter(model, single_rank.tp_group, mode="full")
    link.sync(exporter, 16 << 10)
    before = engine_side.held(link.engine, "full")
    bump(model)
    with pytest.raises(SyncError, match="'time_text_embed.timestep_embedder.linear_1.weight' has shape"):
        link.sync(WrongShape(exporter), 16 << 10)
    assert same(engine_side.held(link.engine, "full"), before)
    link.engine.generate([request()])  # refused before any byte: nothing to repair
