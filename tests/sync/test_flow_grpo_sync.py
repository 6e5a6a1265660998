"""The FlowGRPO loop's weight sync: merged LoRA or adapters only (sync.mode), the engine in this process or
in engine processes (sync.engine_placement=process, a gloo group), and recovery when an engine process
dies in the middle of a sync.  The runs are tiny LoRA runs of 2 steps, compared on their metrics."""
import json
import math

import pytest
import torch

from megatron_omni.config import load_config
from megatron_omni.data.tasks import build_task
from megatron_omni.sync import HFExporter, SyncError, engine_side, updaters
from megatron_omni.trainer.loop import train
from model_specs.common.lora import base_parameters, peft_state_dict
from tests.sync.workers import differing
from tests.trainer.test_flow_grpo import TIMING, TINY

LORA_RUN = TINY + ["train.steps=2", "lora.rank=4"]
PROCESS = ["sync.engine_placement=process", "sync.bucket_mb=1", "sync.checksum=true", "sync.timeout_s=60"]


def _on_send(mp, hook):
    """Route every updater sync through ``hook(updater, exporter, send)``, ``send`` being the real one."""
    for cls in (updaters.InProcessUpdater, updaters.EngineProcessUpdater):
        mp.setattr(cls, "_send", lambda self, x, send=cls._send: hook(self, x, send))


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, single_rank):
    """name -> (run, metrics, export mode of each sync), each run once per module."""
    torch.set_num_threads(1)  # the engine process computes with one thread: so does the in-process engine here
    task, done = build_task("digits"), {}

    def get(name, overrides):
        if name not in done:
            run_dir, modes = tmp_path_factory.mktemp(name), []
            with pytest.MonkeyPatch.context() as mp:
                _on_send(mp, lambda updater, x, send: modes.append(x.mode) or send(updater, x))
                run, _ = train(load_config("digits_flow_grpo", None, LORA_RUN + overrides), single_rank, task, run_dir)
            done[name] = (run, _metrics(run_dir), modes)
        return done[name]
    return get


def test_merged_sync_with_an_engine_process_gives_the_in_process_run(runs):
    _, in_process, modes = runs("merged", ["sync.mode=merged"])
    _, process, _ = runs("merged_process", ["sync.mode=merged"] + PROCESS)
    assert modes == ["merged"] * 3  # the whole model at every sync (start, after each step)
    assert process == in_process  # bit for bit: the weights cross the gloo group unchanged


@pytest.mark.numerics
def test_lora_sync_sends_the_base_once_then_adapters_only(runs):
    run, lora, modes = runs("lora", ["sync.mode=lora"])
    # in process the engine reads the policy's own base tensors: only the adapters move, at every sync
    assert modes == ["lora", "lora", "lora"]
    engine_base, policy_base = base_parameters(run.engine.model), base_parameters(run.policy.module)
    assert engine_base.keys() == policy_base.keys()
    assert all(engine_base[n] is policy_base[n] for n in policy_base)
    # the engine holds the trainer's base weights and its adapters, bit for bit
    base = HFExporter(run.policy.module, run.policy.state.tp_group, mode="full").tensors()
    assert differing(engine_side.held(run.engine, "full"), {n: t.clone() for n, t in base}) == []
    assert differing(engine_side.held(run.engine, "lora"), peft_state_dict(run.policy.module)) == []
    # engine processes: "auto" is "lora" with LoRA on, and the run is the in-process one bit for bit
    _, process, modes = runs("lora_process", PROCESS)
    assert modes == ["full", "lora", "lora", "lora"] and process == lora
    # against merged weights: step 0 is the same bit for bit (B = 0).  After an update the engine computes
    # W x + (alpha/r) B (A x), as the trainer does; a merged engine computes (W + alpha/r B A) x: the same
    # up to float32 rounding, so the runs agree closely but not bit for bit
    _, merged, _ = runs("merged", ["sync.mode=merged"])
    assert lora[0] == merged[0]
    for key, value in merged[1].items():
        assert math.isclose(lora[1][key], value, rel_tol=1e-4, abs_tol=1e-6), (key, lora[1][key], value)


class _KillsAnEngine:
    """An exporter that kills engine process ``proc`` after yielding 3 tensors: an engine that dies in the
    middle of a sync (its peers see a closed connection, as after a crash)."""

    def __init__(self, exporter, proc):
        self.inner, self.proc = exporter, proc

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def tensors(self):
        for i, pair in enumerate(self.inner.tensors()):
            if i == 3:
                self.proc.kill()
                self.proc.join()
            yield pair


def _dying_at(monkeypatch, calls: set[int]):
    """Sync number n (1-based) in ``calls`` loses its engine process midway."""
    count = [0]

    def send(updater, exporter, real):
        count[0] += 1
        if count[0] in calls:
            exporter = _KillsAnEngine(exporter, updater.engine.engines.procs[0])
        return real(updater, exporter)
    _on_send(monkeypatch, send)


def test_engine_dying_mid_sync_is_restarted_and_the_run_goes_on(runs, monkeypatch, tmp_path, single_rank):
    _, lora, _ = runs("lora", ["sync.mode=lora"])
    task = build_task("digits")
    cfg = load_config("digits_flow_grpo", None, LORA_RUN + PROCESS + ["sync.timeout_s=20"])
    # syncs: 1 base, 2 adapters (start); 3 adapters after step 0: the engine dies; restart, 4 base, 5 adapters
    _dying_at(monkeypatch, {3})
    _, done = train(cfg, single_rank, task, tmp_path / "recovered")
    assert [m["sync_restarts"] for m in done] == [1, 0]
    # the restarted engines got the base again, then the adapters: the run is the undisturbed one
    recovered = _metrics(tmp_path / "recovered")
    assert [{**m, "sync_restarts": 0} for m in recovered] == lora
    # a second failure in a row (the re-sync after the restart) is raised
    _dying_at(monkeypatch, {3, 4})
    with pytest.raises(SyncError):
        train(cfg, single_rank, task, tmp_path / "failed")
