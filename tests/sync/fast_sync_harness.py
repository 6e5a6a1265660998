"""A trainer-side sender and an engine-side receiver in one process, for the fast-path sync tests: the
receiver runs each sync in a thread, as an engine process runs it, over a colocated channel (a pipe and
two shared-memory buckets).  No process start per test; the protocol, plan cache and loads are the
real ones."""
from __future__ import annotations

import multiprocessing as mp
import threading

import torch

from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.rollout.engine import EmbeddedEngine, Request
from megatron_omni.sync import (
    SharedMemoryChannel, SyncError, engine_side, receive_weights, send_weights, shared_buffers,
)
from model_specs.common.lora import FLOW_GRPO_TARGETS, apply_lora, lora_modules
from model_specs.qwen_image.model import QwenImageModel
from tests.sync.workers import ARCH, LORA


class InProcessSync:
    def __init__(self, engine, capacity: int = 1 << 20, timeout_s: float = 5.0):
        a, b = mp.Pipe()
        bufs = shared_buffers(capacity)
        self.engine = engine
        self.tx = SharedMemoryChannel(a, bufs, rank=0, timeout_s=timeout_s)
        self.rx = SharedMemoryChannel(b, bufs, rank=1, timeout_s=timeout_s)
        self.received: list = []  # per sync: the receiver's stats, or the exception it raised

    def sync(self, exporter, bucket: int, checksum: bool = False) -> dict:
        """One sync; returns the sender's stats or raises the sender's error (after the receiver ended)."""
        thread = threading.Thread(target=self._receive)
        thread.start()
        try:
            return send_weights(self.tx, 0, 1, exporter.plan(), exporter.tensors(), bucket, exporter.mode, checksum)
        finally:
            thread.join()

    def _receive(self) -> None:
        mode = {}

        def check(m, plan):
            mode["m"] = m
            return engine_side.check_plan(self.engine, m, plan)

        try:
            self.received.append(receive_weights(
                self.rx, 1, check, lambda p: engine_side.load(self.engine, mode["m"], p),
                lambda m: engine_side.held(self.engine, m)))
        except SyncError as e:
            self.received.append(e)


class FailsAfter:
    """An exporter that raises after ``n`` tensors, as a trainer crashing in the middle of a sync."""

    def __init__(self, exporter, n: int):
        self.inner, self.n, self.mode = exporter, n, exporter.mode

    def plan(self):
        return self.inner.plan()

    def tensors(self):
        for i, pair in enumerate(self.inner.tensors()):
            if i == self.n:
                raise RuntimeError("trainer crashed mid-sync")
            yield pair


def make_engine(tp_group=None, lora: bool = False, seed: int = 100, tp_rank: int = 0, tp_size: int = 1
                ) -> EmbeddedEngine:
    """An engine on the tiny model with its own random init (and adapters): only a working sync makes it
    equal to the trainer."""
    torch.manual_seed(seed)
    model = QwenImageModel(ARCH, ARCH.transformer_config(tp_size), tp_group)
    if lora:
        apply_lora(model, LORA["rank"], LORA["alpha"], FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=seed)
    return EmbeddedEngine(model, ARCH, tp_rank=tp_rank, tp_size=tp_size)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def export(exporter) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in exporter.tensors()}


def request() -> Request:
    """A tiny deterministic request (prompt embeddings given: the engine needs no text encoder)."""
    emb = torch.randn(3, ARCH.joint_attention_dim, generator=torch.Generator().manual_seed(0))
    return Request(prompt_emb=emb, seed=1, img_fhw=(1, 2, 2), num_steps=2, sampler="ode")


def adapters_of(model) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors by peft name (TP shards as held)."""
    return {name: t.detach().clone() for m in lora_modules(model).values() for name, t, _ in m.peft_tensors()}


def bump(model, value: float = 0.5) -> None:
    """Change every trainable-or-not parameter in place, as an optimizer step would (references stay valid)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)
