"""FLOPs of a Qwen-Image forward, for the MFU the trainer logs (2 FLOPs per multiply-add).

Per block and token: 12·h² matmul weights (QKV 3h², output h², MLP 8h²) in either stream; joint
attention 4·S²·h per sample (QKᵀ and AV over S = S_T + S_I tokens); the adaLN modulation acts once per
sample (12·h² per block).  BENCHMARKS.md counts the same way (16.6 TFLOP at 512², 60 blocks).
"""
from __future__ import annotations

from model_specs.qwen_image.config import QwenImageConfig


def forward_flops(arch: QwenImageConfig, batch: int, image_tokens: int, text_tokens: int) -> float:
    h, layers = arch.hidden_size, arch.num_layers
    tokens = image_tokens + text_tokens
    per_block = 2 * 12 * h * h * tokens + 4 * tokens * tokens * h + 2 * 12 * h * h
    embed = 2 * h * (arch.in_channels * image_tokens + arch.joint_attention_dim * text_tokens
                     + arch.out_features * image_tokens + 2 * h)
    return float(batch) * (layers * per_block + embed)
