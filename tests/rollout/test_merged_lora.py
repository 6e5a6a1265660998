"""LoRA adapters merged into the rollout's weights (model_specs.common.rollout_linear, ``rollout.lora_weights``): the
merged forward computes the separate one (float32: to rounding) without running the adapters' products, on the
plain and the fused inference paths, with FP8; the copies follow the adapters and are freed while the trainer
runs; training's autograd forward is untouched; a LoRA run trains on the trainer's own π_old."""
import json

import pytest
import torch

import model_specs.common.fp8 as fp8
from checkpoints_convert.qwen_image import qwen_image_rules
from megatron_omni.config import load_config
from megatron_omni.rollout.engine import EmbeddedEngine, EngineConfig, Request
from model_specs.common.fusion import fuse_inference
from model_specs.common.gelu_mlp import GeluMLP
from model_specs.common.lora import FLOW_GRPO_TARGETS, LoRALinear, apply_lora, lora_modules
from model_specs.common.rollout_linear import (
    drop_rollout_weights, enable_fp8, merge_adapters, refresh_rollout_weights, rollout_linears,
)
from model_specs.qwen_image.model import QwenImageModel
from tests.qwen_image_reference import tiny_config
from tests.rollout.test_engine import ToyEncoder

ARCH = tiny_config()
FHW = (1, 4, 4)


@pytest.fixture
def model(single_rank, monkeypatch):
    monkeypatch.setattr(fp8, "MIN_ROWS", 16)  # the tiny model's GEMMs have 16 x batch image rows
    torch.manual_seed(0)
    m = QwenImageModel(ARCH, ARCH.transformer_config(1), single_rank.tp_group)
    apply_lora(m, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=0)
    g = torch.Generator().manual_seed(2)
    for lora in lora_modules(m).values():  # trained adapters: B away from its zero init
        with torch.no_grad():
            lora.lora_B.normal_(std=0.05, generator=g)
    return m


def _inputs(batch=2):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(batch, 16, ARCH.in_channels, generator=g),
            torch.randn(batch, 8, ARCH.joint_attention_dim, generator=g), torch.full((batch,), 0.5), FHW, None)


@pytest.fixture
def low_rank_calls(monkeypatch):
    calls = []
    low_rank = LoRALinear.low_rank

    def spy(self, x):
        calls.append(x.shape[:-1].numel())
        return low_rank(self, x)

    monkeypatch.setattr(LoRALinear, "low_rank", spy)
    return calls


@pytest.mark.parametrize("fused", [False, True])
def test_merged_forward_is_the_separate_one_without_the_adapters_products(model, low_rank_calls, fused):
    if fused:
        assert fuse_inference(model) > 0
    with torch.no_grad():
        separate = model(*_inputs())
    assert low_rank_calls  # (the adapters ran)
    assert merge_adapters(model) == len(lora_modules(model)) > 0
    if fused:  # the fc1 [W | B] copy is not built when fc1's adapter is merged
        fuse_inference(model)
        assert all(m.fused and m.fused_weight is None for m in model.modules() if isinstance(m, GeluMLP))
    low_rank_calls.clear()
    with torch.no_grad():
        merged = model(*_inputs())
    assert low_rank_calls == []
    rel = (merged - separate).norm() / separate.norm()
    assert 0 < rel < 1e-5, rel  # float32: W + s B A rounded once, against the two products added
    # autograd on (the trainer): the base and the adapter apart, bit for bit what the unmerged model computes
    trained = model(*_inputs())
    assert low_rank_calls and torch.equal(trained, model(*_inputs()))
    merge_adapters(model, enable=False)
    assert torch.equal(model(*_inputs()), trained)
    if fused:
        fuse_inference(model)  # ([W | B] rebuilt, as the engine's refresh before each batch does)
    with torch.no_grad():
        assert torch.equal(model(*_inputs()), separate)


def test_merged_weights_follow_the_adapters_and_free_while_training(model):
    merge_adapters(model)
    lora = next(m for n, m in lora_modules(model).items() if n.endswith("attention.linear_proj"))
    torch.testing.assert_close(lora.base.merged_weight, lora.merged_weight().to(lora.base.weight.dtype), rtol=0, atol=0)
    copy = lora.base.merged_weight
    refresh_rollout_weights(model)
    assert lora.base.merged_weight is copy  # unchanged adapters: nothing rebuilt
    with torch.no_grad():
        lora.lora_B.mul_(2.0)  # a sync writes the adapters in place: their version counters move
    refresh_rollout_weights(model)
    assert lora.base.merged_weight is not copy
    torch.testing.assert_close(lora.base.merged_weight - lora.base.weight, 2 * (copy - lora.base.weight),
                               rtol=1e-5, atol=1e-7)
    drop_rollout_weights(model, merged_only=True)
    assert all(m.merged_weight is None for _, m in rollout_linears(model))
    with pytest.raises(RuntimeError, match="refresh_rollout_weights"):
        with torch.no_grad():
            model(*_inputs())
    model(*_inputs())  # (training's forward never reads the copies)


def test_fp8_quantizes_the_merged_weight(model, low_rank_calls):
    enable_fp8(model)
    with torch.no_grad():
        separate = model(*_inputs(batch=1))
    merge_adapters(model)
    lora = next(m for n, m in lora_modules(model).items() if n.endswith("img_mlp.linear_fc2"))
    q, s = fp8.quantize_rows(lora.merged_weight())
    assert torch.equal(lora.base.fp8_weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(lora.base.fp8_scale, s.t()) and lora.base.merged_weight is None  # (no model-dtype copy)
    low_rank_calls.clear()
    with torch.no_grad():
        merged = model(*_inputs(batch=1))
    # the image stream's products (16 rows = MIN_ROWS) hold the adapters; the text stream's 8 rows are
    # below FP8's MIN_ROWS: the model dtype's unmerged base, and the adapters add their own output there
    assert low_rank_calls and all(rows < fp8.MIN_ROWS for rows in low_rank_calls)
    rel = (merged - separate).norm() / separate.norm()
    assert rel < 1e-2, rel  # FP8 of a weight that moved by s B A: another quantization, not another model
    unmerged_fp8 = next(m for n, m in lora_modules(model).items() if n.endswith("txt_mlp.linear_fc1")).base
    unmerged_fp8.set_merged(None)  # (its FP8 copy now quantizes W alone)
    drop_rollout_weights(model, merged_only=True)
    assert lora.base.fp8_weight is None
    assert unmerged_fp8.fp8_weight is not None  # (a base without a merged adapter keeps its copy: it never changes)


def test_engine_merges_as_configured_and_parks(model, low_rank_calls):
    reqs = [Request(prompt="a red cat", img_fhw=FHW, num_steps=3, guidance_scale=4.0, seed=3, window_size=2,
                    window_range=(0, 1), noise_level=1.0)]
    assert EmbeddedEngine(model, ARCH, ToyEncoder()).merged == 0  # auto: separate on a CPU
    separate = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(lora_weights="separate")).generate(reqs)[0]
    engine = EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(lora_weights="merged"))
    assert engine.merged == len(lora_modules(model))
    low_rank_calls.clear()
    merged = engine.generate(reqs)[0]
    assert low_rank_calls == []
    torch.testing.assert_close(merged.latents, separate.latents, rtol=1e-5, atol=1e-5)
    engine.park()
    assert all(m.merged_weight is None for _, m in rollout_linears(model))
    again = engine.generate(reqs)[0]  # rebuilt at the next batch
    assert torch.equal(again.latents, merged.latents)
    with pytest.raises(ValueError, match="lora_weights: expected 'auto', 'merged' or 'separate', got 'yes'"):
        EmbeddedEngine(model, ARCH, ToyEncoder(), EngineConfig(lora_weights="yes"))


# 8 samples x 2 trained pairs = 16 pairs, one optimizer step per RL step: its π_old is its own forward's
TINY = ["train.steps=2", "train.micro_batch_size=8", "train.global_batch_size=16", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_size=2", "algorithm.logprob_check_samples=8",
        "logging.wandb_mode=disabled", "model.arch.num_layers=2", "lora.rank=4", "train.lr=1e-3"]


@pytest.mark.numerics
def test_lora_run_with_merged_rollout_trains_on_the_trainers_old_policy(tmp_path, single_rank):
    """``rollout.lora_weights=merged`` in the loop: the engine's adapters are merged, π_old is the trainer's (with
    one optimizer step per RL step every ratio is exactly 1), the rollout's log-probs are logged against it (as the
    separate adapters' in the first step, where B = 0 makes W + s B A = W; within rounding in the second, after the
    first moved B), the merged copies are freed for the
    trainer's phase, and the rollout's FLOPs lose the adapters'.  On a CPU ``auto`` resolves to separate, with the
    rollout's π_old."""
    from megatron_omni.algorithms.flow_grpo.algorithm import FlowGRPO
    from megatron_omni.data.tasks import build_task
    from megatron_omni.trainer.loop import train

    task = build_task("digits")
    cfg = load_config("digits_flow_grpo", None, TINY + ["rollout.lora_weights=merged"])
    run, _ = train(cfg, single_rank, task, tmp_path / "merged")
    assert run.engine.merged > 0 and run.cfg.rollout_merges_lora and FlowGRPO().trainer_old_policy(run.cfg)
    assert all(m.merged_weight is None for _, m in rollout_linears(run.engine.model))  # (parked for training)
    first, second = [json.loads(line) for line in (tmp_path / "merged" / "metrics.jsonl").read_text().splitlines()]
    for m in (first, second):
        assert m["ratio_mean"] == 1.0 and m["ratio_std"] == 0.0 and m["clipfrac_below"] == 0.0
    # the first step moved the adapters (B != 0), so the second rollout ran on rebuilt copies W + s B A; its log-probs
    # still agree with the trainer's separate adapters (on some CPUs bit for bit: the adapters' share is below
    # float32's rounding of W there -- ATEN_CPU_CAPABILITY=avx2 on an AMD EPYC -- so no strict increase is asserted)
    adapters = lora_modules(run.policy.module).values()
    assert adapters and any(bool(m.lora_B.detach().abs().max() > 0) for m in adapters)
    assert second["logprob_pearson"] > 0.99 and second["logprob_abs_diff"] < 1e-3
    auto = load_config("digits_flow_grpo", None, TINY + ["train.steps=1"])
    run_auto, _ = train(auto, single_rank, task, tmp_path / "auto")
    assert run_auto.cfg.rollout.lora_weights == "separate" and run_auto.engine.merged == 0
    assert not FlowGRPO().trainer_old_policy(run_auto.cfg)
    a = json.loads((tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["logprob_abs_diff"] == a["logprob_abs_diff"]  # B = 0: the merged weights are W, the same rollout
    flops = lambda m: m["tflops_per_second"] * m["step_seconds"]  # noqa: E731
    assert flops(first) < flops(a) and flops(first) == pytest.approx(flops(a), rel=0.05)


def test_memory_estimate_counts_the_merged_copies_and_resolves_auto():
    """The merged copies (the adapted linears' weights in bf16, rollout only) are counted beyond the training
    activations; ``auto`` merges where they fit the device and not where they do not (and never without one)."""
    from megatron_omni.trainer.memory import GIB, HEADROOM, estimate

    base = ["parallel.tp=1", "parallel.cp=1", "parallel.ulysses=1", "lora.rank=64", "lora.alpha=128"]
    merged = estimate(load_config("qwen_image_full", None, base + ["rollout.lora_weights=merged"]), 1)
    separate = estimate(load_config("qwen_image_full", None, base + ["rollout.lora_weights=separate"]), 1)
    part = "merged LoRA weights (beyond the activations)"
    assert merged.lora_merged and not separate.lora_merged and part not in separate.parts
    # Qwen-Image's 12 LoRA targets per block are its per-token linears: 13.6 B of the 20.4 B parameters, in bf16
    adapted = merged.parts[part] + merged.parts["activations (1 micro-batch)"]
    assert 13.4e9 * 2 < adapted < 13.8e9 * 2
    assert merged.total - separate.total == pytest.approx(merged.parts[part])
    auto = load_config("qwen_image_full", None, base)
    assert not estimate(auto, 1).lora_merged  # (no device: separate)
    assert estimate(auto, 1, device_bytes=141 * GIB).lora_merged
    tight = (separate.total + merged.parts[part] / 2) / (1 - HEADROOM)  # fits without the copies only
    assert not estimate(auto, 1, device_bytes=tight).lora_merged
    fp8 = estimate(load_config("qwen_image_full", None, base + ["rollout.lora_weights=merged", "rollout.fp8=true"]), 1)
    assert part not in fp8.parts  # (FP8: the quantized copy holds the adapters)


@pytest.mark.numerics
@pytest.mark.slow  # (a CPU compile: run once, natively, not again under the avx2 pass)
def test_compiled_merged_rollout_has_no_graph_break(model):
    """Under ``rollout.compile`` (torch.compile per block, the engine's fusions on) the merged rollout forward and
    the trainer's forward + backward of the same blocks compile without a graph break and compute what eager does."""
    from torch._dynamo.utils import counters

    from megatron_omni.compile import compile_blocks

    merge_adapters(model)
    fuse_inference(model)
    with torch.no_grad():
        eager = model(*_inputs())
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, "default")
    with torch.no_grad():
        torch.testing.assert_close(model(*_inputs()), eager, rtol=1e-5, atol=1e-6)
    model(*_inputs()).square().mean().backward()
    assert all(lora.lora_B.grad is not None for lora in lora_modules(model).values())
    assert not counters["graph_break"], dict(counters["graph_break"])


def _tp2_merged_vs_separate(state):
    """On each rank of a TP pair: the merged forward's relative distance to the separate one, and whether the
    adapters ran (column-parallel bases: B split, A whole; row-parallel: A split over the pair's input shards)."""
    import model_specs.common.fp8 as fp8_module

    fp8_module.MIN_ROWS = 16
    torch.manual_seed(0)
    m = QwenImageModel(ARCH, ARCH.transformer_config(2), state.tp_group)
    apply_lora(m, 4, 8.0, FLOW_GRPO_TARGETS, qwen_image_rules(ARCH), seed=0)
    for lora in lora_modules(m).values():
        with torch.no_grad():
            lora.lora_B.normal_(std=0.05, generator=torch.Generator().manual_seed(5))
    out = {}
    for fp8_on in (False, True):
        enable_fp8(m, fp8_on)
        merge_adapters(m, enable=False)
        with torch.no_grad():
            separate = m(*_inputs())
        merge_adapters(m)
        with torch.no_grad():
            merged = m(*_inputs())
        out[fp8_on] = float((merged - separate).norm() / separate.norm())
    kinds = {lora.kind for lora in lora_modules(m).values()}
    return out, sorted(kinds)


@pytest.mark.numerics
def test_merged_adapters_at_tp2_compute_the_separate_forward():
    """``rollout.engine_parallel=tp`` with merged adapters: every rank merges its own shards (W_local + s B A_local
    for a row-parallel base), and the TP pair's forward is the separate adapters' (float32: to rounding; FP8: within
    its quantization of a weight moved by s B A)."""
    from megatron_omni.parallel.testing import run_distributed

    for out, kinds in run_distributed(_tp2_merged_vs_separate, 2, parallel={"tp": 2}):
        assert kinds == ["column", "row"]
        assert 0 < out[False] < 1e-5 and out[True] < 1e-2, out


def test_sd3_merged_forward_is_the_separate_one(single_rank, low_rank_calls):
    """A second family through the same switch: SD3.5-M's (dual attention, fused inference paths) merged rollout
    forward equals its separate adapters' to float32 rounding, without the adapters' products."""
    from tests.sd3.test_inference_fusion import _forward, _model
    from tests.sd3.reference import SHAPES, tiny_config

    arch = tiny_config(**SHAPES["3.5-M"])
    sd3 = _model(single_rank, arch, lora=True)
    fuse_inference(sd3, strict=True)
    separate = _forward(sd3, arch)
    assert merge_adapters(sd3) == len(lora_modules(sd3)) > 0
    fuse_inference(sd3, strict=True)
    low_rank_calls.clear()
    merged = _forward(sd3, arch)
    assert low_rank_calls == []
    rel = (merged - separate).norm() / separate.norm()
    assert 0 < rel < 1e-5, rel
