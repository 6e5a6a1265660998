"""FLOPs of a Qwen-Image forward, for the MFU the trainer logs (2 FLOPs per multiply-add).

Per block and token: 12·h² matmul weights (QKV 3h², output h², MLP 8h²) in either stream; joint
attention 4·S²·h per sample (QKᵀ and AV over S = S_T + S_I tokens); the adaLN modulation acts once per
sample (12·h² per block).  BENCHMARKS.md counts the same way (16.6 TFLOP at 512², 60 blocks).

LoRA adapters (``lora_forward_flops``): a rank-r adapter on a K -> N linear costs 2·r·(K + N) per token
(A x, then B h), on the tokens of the linear's stream.
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


def _block_linears(arch: QwenImageConfig) -> dict[str, tuple[int, int, str]]:
    """The block's linears by diffusers name (within ``transformer_blocks.<i>.``): (in, out, stream)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    out = {}
    for stream, prefix, attn in (("image", "img", ("to_q", "to_k", "to_v", "to_out.0")),
                                 ("text", "txt", ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"))):
        out.update({f"attn.{name}": (h, h, stream) for name in attn})
        out.update({f"{prefix}_mlp.net.0.proj": (h, f, stream), f"{prefix}_mlp.net.2": (f, h, stream),
                    f"{prefix}_mod.1": (h, 6 * h, "sample")})
    return out


def lora_forward_flops(arch: QwenImageConfig, rank: int, targets, batch: int, image_tokens: int,
                       text_tokens: int) -> float:
    """FLOPs of the LoRA adapters in one forward over ``batch`` rows: every block linear that ``targets`` selects
    (peft's rule: the name equals a target or ends with ``"." + target``); ValueError for a target that names
    no block linear (its FLOPs would go uncounted)."""
    linears = _block_linears(arch)
    tokens = {"image": image_tokens, "text": text_tokens, "sample": 1}
    chosen = {name for name in linears for t in targets if name == t or name.endswith("." + t)}
    if unknown := [t for t in targets if not any(n == t or n.endswith("." + t) for n in linears)]:
        raise ValueError(f"LoRA targets {unknown} name no Qwen-Image block linear; expected names among "
                         f"{sorted(linears)}")
    per_block = sum(2 * rank * (linears[n][0] + linears[n][1]) * tokens[linears[n][2]] for n in chosen)
    return float(batch) * arch.num_layers * per_block
