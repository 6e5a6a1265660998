"""The per-device memory estimate (megatron_omni.trainer.memory): its parameter counts are the model's own, its
parts follow the layout as the module docstring says, and `megatron-omni train --estimate-memory` prints it or
refuses a layout that cannot fit with one clear error."""
import pytest

from megatron_omni import cli
from megatron_omni.config import load_config
from megatron_omni.trainer.memory import GIB, check_fits, estimate

TINY = ["model.arch.num_layers=2"]


def test_parameter_count_is_the_models_own(single_rank):
    cfg = load_config("digits_flow_grpo", None, TINY)
    family, arch = cfg.model.family_impl, cfg.model.arch
    model = family.build(arch, family.transformer_config(arch, 1), single_rank.tp_group)
    params = sum(p.numel() for p in model.parameters())
    est = estimate(cfg, 1, state=single_rank)
    assert est.parts["parameters"] == params * 4  # float32, whole at TP=1
    assert est.parts["gradients (fp32 main_grad)"] == params * 4 and est.parts["optimizer (Adam)"] == params * 8
    assert est.parts["rollout engine"] >= params * 4  # a full fine-tune's engine holds its own copy


def test_parts_follow_the_layout():
    one = estimate(load_config("qwen_image_full", None, ["parallel.tp=1", "parallel.cp=1", "parallel.ulysses=1"]), 1)
    four = estimate(load_config("qwen_image_full", None, ["parallel.tp=4", "parallel.cp=1", "parallel.ulysses=1"]), 4)
    # the blocks' linears split over TP (the rest is small): about a quarter of the parameters per device
    assert 0.25 < four.parts["parameters"] / one.parts["parameters"] < 0.27
    # activations: per block s*b*h*(10 + 24/t) bytes in 16-bit, 60 blocks, 64 image + 128 text tokens, b = 1
    assert one.parts["activations (1 micro-batch)"] == pytest.approx(60 * 192 * 1 * 3072 * 34)
    assert four.parts["activations (1 micro-batch)"] == pytest.approx(60 * 192 * 1 * 3072 * 16)
    lora = estimate(load_config("qwen_image_full", None, ["parallel.tp=1", "parallel.cp=1", "parallel.ulysses=1",
                                                         "lora.rank=64", "lora.alpha=128"]), 1)
    # LoRA r64: the adapters train (425 M on Qwen-Image's FlowGRPO targets) and the engine reads the policy's base
    adapters = lora.parts["optimizer (Adam)"] / 12
    assert 4.0e8 < adapters < 4.5e8 and lora.parts["rollout engine"] < 0.2 * one.parts["rollout engine"]
    with pytest.raises(ValueError, match="does not fit the device: an estimated .* GiB per device"):
        check_fits(one, 80 * GIB)
    check_fits(lora, 141 * GIB)


def test_fp8_weights_count_one_byte_a_value():
    """rollout.fp8: the engine's e4m3 copies, one byte per weight value of every FP8-capable linear; the merged
    adapters' copies are freed while the trainer runs, so only what exceeds the activations counts for them."""
    over = ["parallel.tp=1", "parallel.cp=1", "parallel.ulysses=1", "lora.rank=64", "lora.alpha=128", "rollout.fp8=true"]
    merged = estimate(load_config("qwen_image_full", None, over), 1)
    separate = estimate(load_config("qwen_image_full", None, over + ["rollout.lora_weights=separate"]), 1)
    # the adapted linears (Qwen-Image's FlowGRPO targets): per block and stream q, k, v, out (3072 x 3072) and the
    # MLP's two 3072 x 12288, at 60 blocks x 2 streams
    adapted = 60 * 2 * (4 * 3072 * 3072 + 2 * 3072 * 12288)
    assert separate.parts["FP8 weights"] - merged.parts["FP8 weights"] == adapted
    assert merged.parts["merged FP8 weights (beyond the activations)"] == \
        adapted - merged.parts["activations (1 micro-batch)"]
    assert "FP8 weights" not in estimate(load_config("qwen_image_full", None, over[:-1]), 1).parts


def test_pipeline_encoders_without_a_folder_are_said_uncounted():
    est = estimate(load_config("qwen_image_flow_grpo", None, []), 1)
    assert "text encoder + VAE" not in est.parts
    assert "not counted: the text encoder + VAE (model.path=None is not a local pipeline folder" in est.table()


def test_cli_prints_or_refuses(capsys):
    argv = ["train", "--recipe", "qwen_image_full", "--estimate-memory", "--world-size", "8"]
    assert cli.main(argv + ["--device-memory", "80"]) == 2
    err = capsys.readouterr().err
    assert "this layout does not fit the device" in err and "TP4 x CP2 (Ulysses 2) x PP1 x DP1 on 8 ranks" in err
    assert cli.main(argv + ["lora.rank=64", "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "memory per device" in out and ": fits" in out and "rollout engine" in out


def test_train_refuses_a_device_too_small_before_building(monkeypatch, single_rank):
    """`megatron-omni train` (and bench/flow_grpo_step.py) call run.check_device_fits before building anything:
    on an accelerator the estimate is held against its memory; on a CPU nothing is checked."""
    from megatron_omni.trainer import run

    cfg = load_config("digits_flow_grpo", None, TINY)
    monkeypatch.setattr(run, "device_memory", lambda state: 1 << 20)  # a 1 MiB accelerator
    with pytest.raises(ValueError, match=r"does not fit the device: .* against 0\.0 GiB usable of 0\.0 GiB"):
        run.check_device_fits(cfg, single_rank)
    monkeypatch.setattr(run, "device_memory", lambda state: 80 * GIB)
    run.check_device_fits(cfg, single_rank)
    monkeypatch.setattr(run, "device_memory", lambda state: None)  # a CPU
    run.check_device_fits(cfg, single_rank)
