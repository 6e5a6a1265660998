"""Colocated weight sync (engine in another process on the same device, shared-memory buckets) in LoRA
adapter-only mode, and a sender that fails mid-sync; a TP=1 trainer in the test process."""
import time
from functools import partial

import pytest
import torch

from megatron_omni.sync import HFExporter, RemoteEngines, SyncError, push_weights
from model_specs.common.lora import peft_state_dict
from tests.sync.workers import TIMEOUT_S, make_engine, trainer_model


class FailsMidSync:
    """The trainer side stops after 5 tensors, as a crashed exporter would: the engine must not hang."""

    def __init__(self, exporter):
        self.inner, self.mode = exporter, exporter.mode

    def plan(self):
        return self.inner.plan()

    def tensors(self):
        for i, pair in enumerate(self.inner.tensors()):
            if i == 5:
                raise RuntimeError("trainer crashed mid-sync")
            yield pair


def test_colocated_lora_only_sync(single_rank):
    torch.set_num_threads(1)
    model = trainer_model(single_rank.tp_group, 0, 1)
    engines = RemoteEngines.spawn(partial(make_engine, lora=True), n=1, placement="colocated", timeout_s=TIMEOUT_S,
                                  bucket_bytes=64 << 10)
    try:
        ref = peft_state_dict(model)
        before = engines.held("lora")[0]
        assert not all(torch.equal(before[k], ref[k]) for k in ref)
        exporter = HFExporter(model, single_rank.tp_group, mode="lora", bucket_bytes=4 << 10)
        stats = push_weights(engines, exporter, 4 << 10, checksum=True)  # 4 KiB < the largest adapter (8 KiB)
        held = engines.held("lora")[0]
        assert stats["tensors"] == len(ref) == 48 and stats["buckets"] > 1
        assert held.keys() == ref.keys() and all(torch.equal(held[k], ref[k]) for k in ref)
        assert max(t.numel() * t.element_size() for t in ref.values()) > 4 << 10

        with torch.no_grad():  # the next sync would change the adapters, but the trainer dies in it
            for p in model.parameters():
                p.add_(1.0)
        t0 = time.perf_counter()
        with pytest.raises(SyncError, match="trainer crashed mid-sync"):
            push_weights(engines, FailsMidSync(HFExporter(model, single_rank.tp_group, mode="lora",
                                                          bucket_bytes=4 << 10)), 4 << 10)
        assert time.perf_counter() - t0 < TIMEOUT_S + 30  # the engine gave up after its timeout, no hang
        after = engines.held("lora")[0]  # still alive, previous adapters intact
        assert all(torch.equal(after[k], ref[k]) for k in ref)
    finally:
        engines.close()
