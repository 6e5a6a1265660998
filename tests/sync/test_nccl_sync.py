"""Weight sync GPU to GPU over a dedicated NCCL group (marker ``gpu``; skips itself with fewer than 2
GPUs): the trainer (this process, GPU 0) pushes the tiny model to an engine process on GPU 1, full and
LoRA-adapters-only, with buckets smaller than the largest tensor; every engine tensor then equals the
trainer's HF export bit for bit.  A hang is turned into stack dumps (faulthandler) instead of silence.

    python -m pytest -q -m gpu tests/sync/test_nccl_sync.py -s
"""
import faulthandler
import sys
import time
from functools import partial

import pytest
import torch

from megatron_omni.parallel.state import destroy_parallel, init_parallel
from megatron_omni.sync import HFExporter, RemoteEngines, SyncError, push_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

HANG_S = 240  # past this, every thread's stack is printed and the process exits


def gpu_engine(lora: bool, index: int, die_file: str | None = None):
    """Engine factory run in the engine process (CUDA_VISIBLE_DEVICES holds its one GPU)."""
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    from checkpoints_convert.qwen_image import qwen_image_rules
    from megatron_omni.parallel.state import init_parallel
    from megatron_omni.rollout.engine import EmbeddedEngine
    from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora
    from model_specs.qwen_image.model import QwenImageModel
    from tests.sync.workers import ARCH, LORA, DyingEngine

    state = init_parallel(seed=100 + index, device="cuda")  # its own random init: only a sync makes it equal
    model = QwenImageModel(ARCH, ARCH.transformer_config(1), state.tp_group)
    if lora:
        apply_lora(model, LORA["rank"], LORA["alpha"], FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=100 + index)
    engine = (DyingEngine if die_file else EmbeddedEngine)(model.to(state.torch_device), ARCH)
    engine.die_file = die_file
    return engine


def test_gpu_to_gpu_sync_over_nccl_is_bit_exact():
    from tests.sync.workers import trainer_model

    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    state = init_parallel(seed=0, device="cuda")
    try:
        model = trainer_model(state.tp_group, 0, 1, lora=True).to(state.torch_device)
        for mode in ("merged", "lora"):
            engines = RemoteEngines.spawn(partial(gpu_engine, mode == "lora"), placement="process", backend="nccl",
                                          timeout_s=60, device=str(state.torch_device),
                                          child_env={"CUDA_VISIBLE_DEVICES": "1"})
            try:
                exporter = HFExporter(model, state.tp_group, mode=mode, bucket_bytes=16 << 10)
                for _ in range(2):  # the second sync reuses the group (and any cached plan)
                    stats = push_weights(engines, exporter, 16 << 10, checksum=True)
                held = engines.held("lora" if mode == "lora" else "full")[0]
                sent = {n: t.cpu() for n, t in exporter.tensors()}
                assert set(held) >= set(sent), set(sent) - set(held)
                assert all(torch.equal(held[n].cpu(), t) for n, t in sent.items()), mode
                assert stats["buckets"] > 1, stats
                print(f"{mode}: {stats['tensors']} tensors, {stats['buckets']} buckets over NCCL, bit-exact")
            finally:
                engines.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
        destroy_parallel()


def test_engine_dying_mid_sync_over_nccl_fails_the_trainer_within_seconds(tmp_path):
    """The engine exits after 3 tensors of a merged sync: the trainer, whose NCCL broadcasts would wait
    for it until the watchdog killed the process, gets a SyncError naming the dead engine instead."""
    from tests.sync.workers import trainer_model

    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    state = init_parallel(seed=0, device="cuda")
    die = tmp_path / "die"
    try:
        model = trainer_model(state.tp_group, 0, 1, lora=True).to(state.torch_device)
        engines = RemoteEngines.spawn(partial(gpu_engine, False, die_file=str(die)), placement="process",
                                      backend="nccl", timeout_s=60, device=str(state.torch_device),
                                      child_env={"CUDA_VISIBLE_DEVICES": "1"})
        try:
            exporter = HFExporter(model, state.tp_group, mode="merged", bucket_bytes=16 << 10)
            push_weights(engines, exporter, 16 << 10)  # a good sync first: the group is up
            die.touch()
            t0 = time.perf_counter()
            with pytest.raises(SyncError, match="engine process 0"):
                push_weights(engines, exporter, 16 << 10)
            seconds = time.perf_counter() - t0
            print(f"dead engine detected in {seconds:.2f} s (sync timeout 60 s)")
            assert seconds < 20, seconds
        finally:
            engines.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
        destroy_parallel()
