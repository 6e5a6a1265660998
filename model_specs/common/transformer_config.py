"""The megatron-core ``TransformerConfig`` of a DiT's blocks: what every family shares (GELU-tanh MLP with biases,
no dropout, no fusions that route through torch.compile on a CPU, the dtype flags) around its own sizes."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch


def dit_transformer_config(*, num_layers: int, hidden_size: int, num_attention_heads: int, kv_channels: int,
                           ffn_hidden_size: int, tp: int, qk_layernorm: bool, params_dtype: torch.dtype,
                           use_cpu_initialization: bool = True, **overrides: Any):
    """``use_cpu_initialization`` makes every TP rank draw the full weight from one seeded CPU generator and keep
    its slice, so a random-init model is the same at any TP size.  ``qk_layernorm``: q / k norm weights are shared
    by all heads but a TP rank sees only its heads; with this flag megatron's finalize_model_grads sums the grads
    of params named "*q_layernorm*" / "*k_layernorm*" over the TP group (the families' module names follow it)."""
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        kv_channels=kv_channels,
        ffn_hidden_size=ffn_hidden_size,
        tensor_model_parallel_size=tp,
        add_bias_linear=True,
        qk_layernorm=qk_layernorm,
        activation_func=partial(torch.nn.functional.gelu, approximate="tanh"),
        gated_linear_unit=False,
        bias_activation_fusion=False,  # True routes through torch.compile (slow first step on CPU)
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
