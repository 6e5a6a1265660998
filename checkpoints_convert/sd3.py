"""SD3 / SD3.5: the one mapping table between diffusers ``SD3Transformer2DModel`` names and
``model_specs.sd3.SD3Model`` names.

Blocks differ (MMDiT-X ``attn2`` in ``dual_attention_layers``, no text output / MLP in the last,
``context_pre_only`` block), so a block's rules depend on its index: :func:`block_rules` (arch, i).
"""
from __future__ import annotations

from checkpoints_convert.mapping import QKV, Rule
from model_specs.sd3.config import SD3Config

COL, ROW = 0, 1  # tp_dim of column- and row-parallel weights (row-parallel biases are whole)


def _linear(mcore: str, hf: str, tp_dim: int | None) -> list[Rule]:
    return [Rule(f"{mcore}.weight", (f"{hf}.weight",), tp_dim=tp_dim),
            Rule(f"{mcore}.bias", (f"{hf}.bias",), tp_dim=COL if tp_dim == COL else None)]


def _qkv(mcore: str, hf: str, names: tuple[str, str, str]) -> list[Rule]:
    return [Rule(f"{mcore}.{p}", tuple(f"{hf}.{n}.{p}" for n in names), QKV, COL) for p in ("weight", "bias")]


def _norms(mcore: str, hf: str, pairs: tuple[tuple[str, str], ...]) -> list[Rule]:
    return [Rule(f"{mcore}.{ours}.weight", (f"{hf}.{theirs}.weight",)) for ours, theirs in pairs]


GLOBAL_RULES: list[Rule] = [
    *_linear("patch_embed", "pos_embed.proj", None),
    Rule("pos_embed", ("pos_embed.pos_embed",)),  # the sincos table: a persistent buffer in both
    *_linear("time_linear_1", "time_text_embed.timestep_embedder.linear_1", COL),
    *_linear("time_linear_2", "time_text_embed.timestep_embedder.linear_2", ROW),
    *_linear("pooled_linear_1", "time_text_embed.text_embedder.linear_1", COL),
    *_linear("pooled_linear_2", "time_text_embed.text_embedder.linear_2", ROW),
    *_linear("context_embedder", "context_embedder", None),
    *_linear("norm_out_linear", "norm_out.linear", None),
    *_linear("proj_out", "proj_out", None),
]


def block_rules(arch: SD3Config, i: int) -> list[Rule]:
    """Block i's rules, its names expanded."""
    b, hb = f"blocks.{i}", f"transformer_blocks.{i}"
    qk_norm = arch.qk_norm is not None
    last = i == arch.num_layers - 1
    rules = [
        *_linear(f"{b}.img_mod", f"{hb}.norm1.linear", COL),
        *_linear(f"{b}.txt_mod", f"{hb}.norm1_context.linear", COL),
        *_qkv(f"{b}.attention.linear_qkv", f"{hb}.attn", ("to_q", "to_k", "to_v")),
        *_qkv(f"{b}.attention.linear_added_qkv", f"{hb}.attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
        *_linear(f"{b}.attention.linear_proj", f"{hb}.attn.to_out.0", ROW),
        *_linear(f"{b}.img_mlp.linear_fc1", f"{hb}.ff.net.0.proj", COL),
        *_linear(f"{b}.img_mlp.linear_fc2", f"{hb}.ff.net.2", ROW),
    ]
    if qk_norm:
        rules += _norms(f"{b}.attention", f"{hb}.attn", (("q_layernorm", "norm_q"), ("k_layernorm", "norm_k"),
                                                         ("added_q_layernorm", "norm_added_q"),
                                                         ("added_k_layernorm", "norm_added_k")))
    if not last:
        rules += [*_linear(f"{b}.attention.linear_added_proj", f"{hb}.attn.to_add_out", ROW),
                  *_linear(f"{b}.txt_mlp.linear_fc1", f"{hb}.ff_context.net.0.proj", COL),
                  *_linear(f"{b}.txt_mlp.linear_fc2", f"{hb}.ff_context.net.2", ROW)]
    if i in arch.dual_attention_layers:
        rules += [*_qkv(f"{b}.attention2.linear_qkv", f"{hb}.attn2", ("to_q", "to_k", "to_v")),
                  *_linear(f"{b}.attention2.linear_proj", f"{hb}.attn2.to_out.0", ROW)]
        if qk_norm:
            rules += _norms(f"{b}.attention2", f"{hb}.attn2", (("q_layernorm", "norm_q"), ("k_layernorm", "norm_k")))
    return rules


def sd3_rules(arch: SD3Config) -> list[Rule]:
    """The table of a whole model: global tensors, then every block's in order."""
    return list(GLOBAL_RULES) + [r for i in range(arch.num_layers) for r in block_rules(arch, i)]
