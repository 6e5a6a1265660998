"""Qwen-Image: the one mapping table between diffusers ``QwenImageTransformer2DModel`` names and
``model_specs.qwen_image.QwenImageModel`` names."""
from __future__ import annotations

from checkpoints_convert.mapping import QKV, Rule, expand_rules
from model_specs.qwen_image.config import QwenImageConfig

COL, ROW = 0, 1  # tp_dim of column- and row-parallel weights (row-parallel biases are whole)


def _linear(mcore: str, hf: str, tp_dim: int | None) -> list[Rule]:
    return [Rule(f"{mcore}.weight", (f"{hf}.weight",), tp_dim=tp_dim),
            Rule(f"{mcore}.bias", (f"{hf}.bias",), tp_dim=COL if tp_dim == COL else None)]


def _qkv(mcore: str, hf_q: str, hf_k: str, hf_v: str) -> list[Rule]:
    return [Rule(f"{mcore}.{p}", (f"{hf_q}.{p}", f"{hf_k}.{p}", f"{hf_v}.{p}"), QKV, COL) for p in ("weight", "bias")]


GLOBAL_RULES: list[Rule] = [
    *_linear("time_linear_1", "time_text_embed.timestep_embedder.linear_1", COL),
    *_linear("time_linear_2", "time_text_embed.timestep_embedder.linear_2", ROW),
    Rule("txt_norm.weight", ("txt_norm.weight",)),
    *_linear("txt_in", "txt_in", None),
    *_linear("img_in", "img_in", None),
    *_linear("norm_out_linear", "norm_out.linear", None),
    *_linear("proj_out", "proj_out", None),
]

_B, _HB = "blocks.{i}", "transformer_blocks.{i}"
BLOCK_RULES: list[Rule] = [
    *_linear(f"{_B}.img_mod", f"{_HB}.img_mod.1", COL),
    *_linear(f"{_B}.txt_mod", f"{_HB}.txt_mod.1", COL),
    *_qkv(f"{_B}.attention.linear_qkv", f"{_HB}.attn.to_q", f"{_HB}.attn.to_k", f"{_HB}.attn.to_v"),
    *_qkv(f"{_B}.attention.linear_added_qkv", f"{_HB}.attn.add_q_proj", f"{_HB}.attn.add_k_proj",
          f"{_HB}.attn.add_v_proj"),
    Rule(f"{_B}.attention.q_layernorm.weight", (f"{_HB}.attn.norm_q.weight",)),
    Rule(f"{_B}.attention.k_layernorm.weight", (f"{_HB}.attn.norm_k.weight",)),
    Rule(f"{_B}.attention.added_q_layernorm.weight", (f"{_HB}.attn.norm_added_q.weight",)),
    Rule(f"{_B}.attention.added_k_layernorm.weight", (f"{_HB}.attn.norm_added_k.weight",)),
    *_linear(f"{_B}.attention.linear_proj", f"{_HB}.attn.to_out.0", ROW),
    *_linear(f"{_B}.attention.linear_added_proj", f"{_HB}.attn.to_add_out", ROW),
    *_linear(f"{_B}.img_mlp.linear_fc1", f"{_HB}.img_mlp.net.0.proj", COL),
    *_linear(f"{_B}.img_mlp.linear_fc2", f"{_HB}.img_mlp.net.2", ROW),
    *_linear(f"{_B}.txt_mlp.linear_fc1", f"{_HB}.txt_mlp.net.0.proj", COL),
    *_linear(f"{_B}.txt_mlp.linear_fc2", f"{_HB}.txt_mlp.net.2", ROW),
]


def qwen_image_rules(arch: QwenImageConfig) -> list[Rule]:
    return expand_rules(GLOBAL_RULES, BLOCK_RULES, arch.num_layers)
