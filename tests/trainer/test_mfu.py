"""The FLOP counters behind the MFU the trainer and the benchmarks report (docs/benchmarks.md's accounting)."""
import pytest

from megatron_omni.trainer.mfu import forward_flops, step_flops, varlen_step_flops
from model_specs.qwen_image.config import QwenImageConfig
from model_specs.qwen_image.flops import forward_flops as qwen_image_forward_flops


def test_forward_flops_dispatch_by_family():
    arch = QwenImageConfig()
    assert forward_flops(arch, 2, 1024, 128) == qwen_image_forward_flops(arch, 2, 1024, 128)
    assert forward_flops(arch, 1, 1024, 128) == pytest.approx(16.6e12, rel=0.01)  # 512^2 + 128 text tokens
    with pytest.raises(ValueError, match="dict names no model family"):
        forward_flops({}, 1, 1, 1)


def _phases(samples=16, steps=10, window=2, cfg=True, frozen=True, per_row=lambda n: (1.0, 0.0), **kw):
    """{rollout, train} FLOPs of the recipe's shape: rollout rows alone (no pairs), then training alone."""
    uncond = 128 if cfg else None
    return {"rollout": varlen_step_flops(per_row, [(128, uncond, 0)] * samples, rollout_steps=steps,
                                         frozen_base=frozen),
            "train": varlen_step_flops(per_row, [(128, uncond, window)] * samples, rollout_steps=0,
                                       frozen_base=frozen, **kw)}


def test_lora_cfg_recipe_is_26_forwards_per_image():
    """10 rollout steps x 2 (CFG) + 2 window steps x (cond forward + uncond forward + activation backward)."""
    phases = _phases()
    assert phases == {"rollout": 320.0, "train": 96.0}
    assert (phases["rollout"] + phases["train"]) / 16 == 26
    full = _phases(cfg=False, frozen=False)
    assert full["train"] == 32 * 3 and full["rollout"] == 160


def test_step_flops_backward_of_a_frozen_base():
    assert step_flops(1.0, rollout_rows=10, check_rows=2, train_rows=4, extra_forward_rows=4) == 10 + 2 + 12 + 4
    assert step_flops(1.0, 10, 2, 4, 4, frozen_base=True) == 10 + 2 + 8 + 4


def test_reused_uncond_counts_no_uncond_forward():
    """With the rollout's uncond output reused, a trained pair of the LoRA + CFG recipe is 2 forward-equivalents
    (cond forward + activation backward): 24 per image instead of 26; the log-prob check then runs cond rows."""
    assert _phases(reused_uncond_pairs=32) == {"rollout": 320.0, "train": 64.0}
    assert _phases(reused_uncond_pairs=16)["train"] == 32 * 2 + 16
    check = varlen_step_flops(lambda n: (1.0, 0.0), [(128, 128, 2)] * 16, rollout_steps=0, frozen_base=True,
                              reused_uncond_pairs=32, check_samples=2, check_reuses_uncond=True)
    assert check == 64 + 4


def test_lora_adapter_flops_qwen_image():
    """2·r·(in + out) per token and adapted linear, on its stream's tokens: the FlowGRPO targets at full size,
    r 64, 512² + 128 text tokens are ~3.1 % of the forward; one block's linear, a model-level one; unknown
    targets are refused."""
    from model_specs.common.lora import FLOW_GRPO_TARGETS
    from megatron_omni.trainer.mfu import lora_forward_flops

    arch = QwenImageConfig()
    h, f, r = arch.hidden_size, arch.ffn_hidden_size, 64
    per_token = 4 * 2 * r * (h + h) + 2 * 2 * r * (h + f)  # either stream: q, k, v, out (h -> h); fc1, fc2
    expected = 60 * per_token * (1024 + 128)
    assert lora_forward_flops(arch, r, FLOW_GRPO_TARGETS, 1, 1024, 128) == pytest.approx(expected)
    assert lora_forward_flops(arch, r, FLOW_GRPO_TARGETS, 1, 1024, 128) / forward_flops(arch, 1, 1024, 128) \
        == pytest.approx(0.031, abs=0.002)
    assert lora_forward_flops(arch, r, ["to_q"], 3, 1024, 128) == 3 * 60 * 2 * r * 2 * h * 1024
    assert lora_forward_flops(arch, r, ["transformer_blocks.3.attn.to_q"], 1, 1024, 128) == 2 * r * 2 * h * 1024
    assert lora_forward_flops(arch, r, ["proj_out"], 2, 1024, 128) == 2 * 2 * r * (h + 64) * 1024
    assert lora_forward_flops(arch, 0, FLOW_GRPO_TARGETS, 1, 1024, 128) == 0.0
    with pytest.raises(ValueError, match=r"LoRA targets \['to_z'\] name no Qwen-Image linear"):
        lora_forward_flops(arch, r, ["to_q", "to_z"], 1, 1024, 128)


def test_adapter_flops_per_phase():
    """Policy forwards carry A each, a trained row 3·A; the KL reference's rows the base alone."""
    assert step_flops(1.0, 10, 2, 4, 4, frozen_base=True, adapter_flops_per_row=0.5, reference_rows=3) \
        == (10 + 2 + 8 + 4 + 3) + 0.5 * (10 + 2 + 4 + 4 + 2 * 4)
    phases = _phases(per_row=lambda n: (1.0, 0.1), reused_uncond_pairs=32)
    assert phases["rollout"] == pytest.approx(320 * 1.1) and phases["train"] == pytest.approx(64 + 0.3 * 32)


def test_varlen_step_flops_counts_each_row_at_its_text_length():
    """Rows at one text length give step_flops' count; rows at several are counted at their own (by hand)."""
    same = varlen_step_flops(lambda n: (1.0, 0.0), [(128, 128, 2)] * 16, rollout_steps=10, frozen_base=True,
                             reused_uncond_pairs=32, check_samples=4, check_reuses_uncond=True)
    assert same == step_flops(1.0, 16 * 10 * 2, 4 * 2, 32, 0, frozen_base=True)
    # sample 0: prompt of 10 tokens, 2 pairs (both reuse the rollout's uncond), checked with uncond rows;
    # sample 1: 20 tokens, 1 pair (recomputes its uncond); negative prompt 2 tokens; KL reference on
    got = varlen_step_flops(lambda n: (float(n), 0.1 * n), [(10, 2, 2), (20, 2, 1)], rollout_steps=3,
                            frozen_base=True, reused_uncond_pairs=2, check_samples=1, kl=True)
    by_hand = (10 * (5 + 2 + 2 + 2) + 1 * (5 + 2 + 4)  # 10 tokens: 3 rollout + 2 check forwards, 2 trained, 2 ref
               + 20 * (3 + 1 + 1 + 1) + 2 * (3 + 1 + 2)  # 20 tokens: 3 rollout forwards, 1 trained, 1 ref
               + 2 * (9 + 3) + 0.2 * 9)  # 2 tokens: 6 rollout + 2 check + 1 recomputed forwards, 3 ref
    assert got == pytest.approx(by_hand)
    assert varlen_step_flops(lambda n: (1.0, 0.0), [(8, None, 2)], rollout_steps=4, frozen_base=False) == 4 + 2 * 3


@pytest.mark.parametrize("tp,cp,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_mfu_is_per_device_of_a_replica(monkeypatch, tp, cp, pp):
    """A step's FLOPs are one data-parallel replica's, shared by its tp x cp x pp devices: the loop's MFU divides
    the replica's rate by their summed peak (TFLOP/s stays the replica's)."""
    from types import SimpleNamespace

    import torch

    from megatron_omni.trainer import loop, mfu

    monkeypatch.setattr(mfu, "device_peak_flops", lambda dtype: 800e12)
    run = SimpleNamespace(cfg=SimpleNamespace(model=SimpleNamespace(torch_dtype=torch.bfloat16)),
                          policy=SimpleNamespace(state=SimpleNamespace(tp=tp, cp=cp, pp=pp)))
    out = loop.utilisation(run, 400e12 * 2.0, 2.0)  # 400 TFLOP/s achieved by the replica
    assert out["tflops_per_second"] == pytest.approx(400.0)
    assert out["mfu"] == pytest.approx(0.5 / (tp * cp * pp))
    monkeypatch.setattr(mfu, "device_peak_flops", lambda dtype: None)  # unknown peak (a CPU): no MFU
    assert "mfu" not in loop.utilisation(run, 1e12, 1.0)
