"""The in-process rollout engine laid out over the trainer's groups (``rollout.engine_parallel``,
megatron_omni.trainer.build): at TP2 each rank holds its TP shard of the engine (about half the whole engine's
bytes), the TP pair generates the same requests together, and each sync copies the rank's own shards into it (no TP
gather: ``HFExporter.tensors`` is never called); with LoRA it reads the policy's base tensors.  The loop then gives
the whole-engine run's metrics: the rollout's GEMMs split their sums over the TP pair (CP: the image tokens over
the CP pair), so float32 rounding differs, and a 2-step digits run agrees within rel 1e-5 / abs 1e-7."""
from __future__ import annotations

import pytest

from megatron_omni.config import load_config
from megatron_omni.config.schema import ConfigError
from megatron_omni.parallel.testing import run_distributed
from tests.trainer.test_loop_layouts import TIMING, TINY
from tests.trainer.test_loop_layouts import _close as close

pytestmark = [pytest.mark.numerics, pytest.mark.slow]
REL, ABS = 1e-5, 1e-7  # measured: <= 7e-7 relative (rewards, grad_norm), 3e-8 absolute (a loss of ~0)
LORA = ["lora.rank=4", "lora.alpha=8", "train.lr=1e-3"]


def _runs(state, variants: dict[str, list[str]], out):
    """Each variant's 2-step digits run on this layout: its metrics, the engine's bytes on this rank, whether a
    sync gathered over TP, and how the engine's tensors relate to the policy's."""
    import torch

    from megatron_omni.data.tasks import build_task
    from megatron_omni.rollout.engine import Request, check_same_requests
    from megatron_omni.sync.exporter import HFExporter
    from megatron_omni.trainer.loop import train
    from model_specs.common.lora import base_tensors, lora_modules

    def adapters(model):
        return {n: t for m in lora_modules(model).values() for n, t, _ in m.peft_tensors()}

    torch.set_num_threads(1)
    gathered, real = [0], HFExporter.tensors
    HFExporter.tensors = lambda self: (gathered.__setitem__(0, gathered[0] + 1), real(self))[1]
    results = {}
    for name, overrides in variants.items():
        gathered[0] = 0
        run, done = train(load_config("digits_flow_grpo", None, overrides), state, build_task("digits"), out / name)
        engine, policy = base_tensors(run.engine.model), base_tensors(run.policy.module)
        results[name] = {
            "metrics": [{k: v for k, v in m.items() if k not in TIMING} for m in done],
            "engine_bytes": sum(t.numel() * t.element_size() for t in run.engine.model.parameters()),
            "gathered": gathered[0],
            "tp_size": run.engine.tp_size,
            "shared": all(engine[n] is policy[n] for n in policy),
            "equal": engine.keys() == policy.keys() and all(engine[n].shape == policy[n].shape
                                                            and torch.equal(engine[n], policy[n]) for n in policy),
            "adapters_equal": _same(adapters(run.engine.model), adapters(run.policy.module))}
    HFExporter.tensors = real
    try:  # the TP pair given different requests: refused before any forward
        group = state.tp_group if state.tp > 1 else state.cp_group
        check_same_requests([Request(prompt="a", seed=torch.distributed.get_rank(group))], [group])
        results["mismatch"] = ""
    except RuntimeError as e:
        results["mismatch"] = str(e)
    return results


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(a[n].shape == b[n].shape and torch.equal(a[n], b[n]) for n in a)


def _close(got: list[dict], want: list[dict]) -> None:
    close(got, want, REL, ABS)


def test_tp_sharded_engine_equals_the_whole_engine_at_tp2(tmp_path):
    """Full fine-tuning and LoRA at TP2: engine_parallel=tp against whole, one launch of 2 gloo ranks."""
    base = TINY + ["parallel.tp=2"]
    variants = {"whole": base + ["rollout.engine_parallel=whole"], "tp": base + ["rollout.engine_parallel=tp"],
                "lora_whole": base + LORA + ["rollout.engine_parallel=whole"],
                "lora_tp": base + LORA + ["rollout.engine_parallel=tp"]}
    ranks = run_distributed(_runs, world_size=2, parallel={"tp": 2}, args=(variants, tmp_path), timeout_s=600)
    for name in variants:
        assert ranks[0][name]["metrics"] == ranks[1][name]["metrics"]  # every rank reports the step alike
    r = ranks[0]
    _close(r["tp"]["metrics"], r["whole"]["metrics"])
    _close(r["lora_tp"]["metrics"], r["lora_whole"]["metrics"])
    assert r["whole"]["metrics"][1]["grad_norm"] > 0 and r["lora_whole"]["metrics"][1]["grad_norm"] > 0
    assert [r[n]["tp_size"] for n in variants] == [1, 2, 1, 2]
    # the shard: the blocks' linears halved, the rest (norms, embedders, the adaLN modulations) whole
    assert 0.5 <= r["tp"]["engine_bytes"] / r["whole"]["engine_bytes"] < 0.6
    # syncs into the shard: this rank's own tensors, no TP gather; the engine then holds the policy's shard exactly
    assert r["tp"]["gathered"] == 0 and r["whole"]["gathered"] > 0
    assert r["tp"]["equal"] and not r["tp"]["shared"]
    # LoRA: the sharded engine reads the policy's own base tensors (only adapters move: nothing gathered)
    assert r["lora_tp"]["shared"] and r["lora_tp"]["gathered"] == 0 and not r["lora_whole"]["shared"]
    assert r["lora_tp"]["adapters_equal"]  # this rank's adapter shards, as the policy holds them after the last step
    assert "were given different requests" in r["mismatch"]


def test_cp_split_engine_equals_the_whole_sequence_engine_at_cp2(tmp_path):
    """engine_parallel=tp_cp at CP2 (ring): each rollout forward's image tokens split over the CP pair, as training
    splits them, against every CP rank running the whole sequence."""
    base = TINY + ["parallel.cp=2"]
    variants = {"whole": base + ["rollout.engine_parallel=whole"], "tp_cp": base + ["rollout.engine_parallel=tp_cp"],
                "lora_tp_cp": base + LORA + ["rollout.engine_parallel=tp_cp"]}
    ranks = run_distributed(_runs, world_size=2, parallel={"cp": 2}, args=(variants, tmp_path), timeout_s=600)
    r = ranks[0]
    assert r["tp_cp"]["metrics"] == ranks[1]["tp_cp"]["metrics"]
    _close(r["tp_cp"]["metrics"], r["whole"]["metrics"])
    assert r["tp_cp"]["equal"] and r["tp_cp"]["gathered"] == 0  # TP=1 on both sides: the policy's tensors as held
    # LoRA at CP2: the engine reads the policy's base (CP replicates the weights) and holds its adapters; its first
    # rollout (B = 0: the base model) is the full fine-tune's
    lora = r["lora_tp_cp"]
    assert lora["shared"] and lora["adapters_equal"] and lora["metrics"][1]["grad_norm"] > 0
    assert lora["metrics"][0]["reward_mean"] == pytest.approx(r["tp_cp"]["metrics"][0]["reward_mean"], rel=REL, abs=ABS)
    assert "were given different requests" in r["mismatch"]


def test_shard_load_checks_every_tensor_before_copying(single_rank):
    """``engine_side.load_shards``: the policy's own tensors go in as they are; an unknown name or a wrong shape is
    refused with the engine unchanged."""
    import torch

    from megatron_omni.sync import HFExporter, engine_side
    from model_specs.common.lora import base_tensors
    from tests.sync.fast_sync_harness import make_engine

    policy, engine = make_engine(single_rank.tp_group, seed=1).model, make_engine(single_rank.tp_group, seed=2)
    pairs = list(HFExporter(policy, None, mode="full").shards())
    assert engine_side.load_shards(engine, "full", pairs) == len(pairs)
    assert _same(base_tensors(engine.model), base_tensors(policy))
    before = {n: t.clone() for n, t in base_tensors(engine.model).items()}
    (name, t), *rest = [(n, t + 1) for n, t in pairs]
    with pytest.raises(ValueError, match=f"shard load \\(full\\): tensor '{name}' has shape \\(3,\\)"):
        engine_side.load_shards(engine, "full", rest + [(name, torch.zeros(3))])
    with pytest.raises(ValueError, match="tensor 'blocks.99.x' is not a parameter of the engine's model"):
        engine_side.load_shards(engine, "full", rest + [("blocks.99.x", t)])
    assert _same(base_tensors(engine.model), before)


def test_bad_engine_parallel_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"rollout.engine_parallel: invalid choice 'tp2' \(allowed: auto, whole, tp, "
                                          r"tp_cp\)"):
        load_config("digits_flow_grpo", None, ["rollout.engine_parallel=tp2"])
    with pytest.raises(ConfigError, match="rollout.engine_parallel: tp lays out the in-process engine .* expected "
                                          "whole or auto, or sync.engine_placement=in_process"):
        load_config("digits_flow_grpo", None, ["rollout.engine_parallel=tp", "sync.engine_placement=process"])


def test_estimate_counts_the_engine_shard_and_resolves_auto():
    from megatron_omni.trainer.memory import GIB, estimate

    full = ["parallel.tp=4", "parallel.cp=1", "parallel.ulysses=1"]
    whole = estimate(load_config("qwen_image_full", None, full + ["rollout.engine_parallel=whole"]), 4)
    sharded = estimate(load_config("qwen_image_full", None, full + ["rollout.engine_parallel=tp"]), 4)
    assert whole.engine_tp == 1 and sharded.engine_tp == 4 and "engine TP4-sharded" in sharded.layout
    # the engine's copy: about a quarter (its blocks' linears split; the adaLN modulations, embedders whole)
    assert 0.25 < sharded.parts["rollout engine"] / whole.parts["rollout engine"] < 0.3
    auto = load_config("qwen_image_full", None, full)
    assert estimate(auto, 4).engine_tp == 1  # no device (a CPU): whole, as before
    assert estimate(auto, 4, device_bytes=1000 * GIB).engine_tp == 1  # the whole engine fits
    assert estimate(auto, 4, device_bytes=80 * GIB).engine_tp == 4  # it does not: sharded
    lora = estimate(load_config("qwen_image_full", None, full + LORA[:2] + ["rollout.engine_parallel=tp"]), 4)
    assert lora.parts["rollout engine"] < 0.1 * sharded.parts["rollout engine"]  # it reads the policy's base
