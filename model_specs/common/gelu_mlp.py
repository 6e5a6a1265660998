"""megatron-core's MLP with an inference fast path: fc1's bias and GELU-tanh in the GEMM's epilogue.

Why: in the rollout forward of a DiT, the GELU after fc1 is a separate pass over fc1's output (the
widest activation of the block: [tokens, 4 * hidden]); on an H200 at batch 32 it was 40 ms of a
981 ms compiled forward (bench/RESULTS.md).
cuBLASLt applies bias + GELU-tanh while the GEMM writes its output (``torch._addmm_activation``), so the
pass disappears.  That kernel has no backward, so the fast path runs only without autograd (the rollout
engine, ``model_specs.common.fusion.fuse_inference``); training keeps megatron's own path.

With a LoRA adapter on fc1 (``model_specs.common.lora.LoRALinear``, one part), the epilogue would need
the adapter's output added before GELU, which a separate low-rank GEMM cannot do.  The adapter's
up-projection is folded into the base GEMM along K instead:
    x W^T + s (x A^T) B^T = [x | s * x A^T] [W | B]^T,
one GEMM over K + r columns whose fp32 accumulator holds base and adapter together (the unfused path
rounds each to bf16 before adding them).  ``[W | B]`` is a copy of fc1's weight with the adapter's B
beside it, refreshed by ``refresh_fused`` (the engine calls it before each batch: B changes with every
weight sync; ~9 GB for the full-size Qwen-Image's 120 fc1s: a few ms of copying at HBM bandwidth, not timed
on its own — it is inside the measured rollout).

Only the CUDA kernel fuses; elsewhere the same math runs as addmm then GELU-tanh (the CPU's
``_addmm_activation`` computes the exact-erf GELU, not the tanh form this model uses).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from model_specs.common import fp8
from model_specs.common.fusion import local_column
from model_specs.common.lora import COLUMN, LoRALinear
from model_specs.common.norm_quantize import FP8Input
from model_specs.common.rollout_linear import RolloutLinear, uses_fp8


def _is_gelu_tanh(fn) -> bool:
    return isinstance(fn, functools.partial) and fn.func is F.gelu and fn.keywords == {"approximate": "tanh"}


def linear_gelu_tanh(x_MK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x W^T + b) for 2-D x, in the GEMM's epilogue on CUDA."""
    if x_MK.is_cuda:
        return torch._addmm_activation(bias_N, x_MK, weight_NK.t(), use_gelu=True)
    return F.gelu(torch.addmm(bias_N, x_MK, weight_NK.t()), approximate="tanh")


@torch.library.custom_op("megatron_omni::lora_linear_gelu_tanh", mutates_args=())
def lora_linear_gelu_tanh(x_MK: torch.Tensor, a_RK: torch.Tensor, scaling: float, w_cat_NK: torch.Tensor,
                          bias_N: torch.Tensor) -> torch.Tensor:
    """gelu_tanh([x | s x A^T] [W | B]^T + b), forward only.  One opaque op: torch.compile keeps the skinny
    x A^T product on x's own contiguous buffer (0.07 ms at the rollout's [32 k, 3072] x [3072, 64] on an H200,
    bench/lora_projection.py) and the concatenation a plain copy feeding the epilogue GEMM."""
    h_MR = F.linear(x_MK, a_RK) * scaling
    return linear_gelu_tanh(torch.cat([x_MK, h_MR], dim=-1), w_cat_NK, bias_N)


@lora_linear_gelu_tanh.register_fake
def _(x_MK, a_RK, scaling, w_cat_NK, bias_N):
    return x_MK.new_empty(x_MK.shape[0], w_cat_NK.shape[0])


class GeluMLP(MLP):
    """``MLP`` (fc1 -> GELU-tanh -> fc2) whose forward takes the fused path once ``fused`` is set and
    autograd is off; otherwise exactly megatron-core's forward."""

    fused = False  # set by model_specs.common.fusion.fuse_inference

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # [W | B] of a LoRA'd fc1; a buffer so that sleep()/wake() (model.to) move it, not in checkpoints
        self.register_buffer("fused_weight", None, persistent=False)

    def fusable(self) -> str:
        """'' when the fused path computes what ``MLP.forward`` does for this module; else why not."""
        cfg, fc1 = self.config, self.linear_fc1
        base = fc1.base if isinstance(fc1, LoRALinear) else fc1
        if cfg.gated_linear_unit or not _is_gelu_tanh(self.activation_func):
            return f"activation {self.activation_func!r} is not GELU-tanh without gating"
        if not local_column(base):
            return (f"fc1 is a {type(base).__name__}; expected megatron-core's local column-parallel linear with a "
                    f"bias, without sequence parallelism or output gather")
        if uses_fp8(base):
            return self._fp8_fusable()
        if isinstance(fc1, LoRALinear) and (fc1.kind != COLUMN or fc1.lora_A.shape[0] != 1):
            return f"fc1's LoRA adapter has {fc1.lora_A.shape[0]} parts ({fc1.kind}); expected one, column-parallel"
        return ""

    @torch.no_grad()
    def refresh_fused(self) -> None:
        """Rebuild ``[W | B]`` from the current weights (LoRA on fc1 only; nothing to do otherwise)."""
        fc1 = self.linear_fc1
        if not self.fused or not isinstance(fc1, LoRALinear) or not fc1.enabled or uses_fp8(fc1) \
                or getattr(fc1.base, "_merge_on", False):  # (merged: the rollout's weight holds the adapter)
            self.fused_weight = None
            return
        w_NK, b_NR = fc1.base.weight, fc1.lora_B[0]
        n, k = w_NK.shape
        cat = self.fused_weight
        if cat is None or cat.shape != (n, k + b_NR.shape[1]) or cat.device != w_NK.device or cat.dtype != w_NK.dtype:
            self.fused_weight = cat = torch.empty(n, k + b_NR.shape[1], device=w_NK.device, dtype=w_NK.dtype)
        torch._foreach_copy_([cat[:, :k], cat[:, k:]], [w_NK, b_NR])

    def forward(self, hidden_states: torch.Tensor | FP8Input, *args, **kwargs):
        """``hidden_states``: the activation, or (a block's one-pass adaLN path) an ``FP8Input`` of it."""
        if isinstance(hidden_states, FP8Input):
            return self._fp8_forward(hidden_states)
        if not self.fused or torch.is_grad_enabled() or args or kwargs:
            return super().forward(hidden_states, *args, **kwargs)
        fc1 = self.linear_fc1
        x_MK = hidden_states.reshape(-1, hidden_states.shape[-1])
        if uses_fp8(fc1):
            if x_MK.shape[0] < fp8.MIN_ROWS:  # (too few rows for FP8: the model dtype's path)
                return super().forward(hidden_states)
            return self._fp8_forward(FP8Input(*fp8.quantize_rows(x_MK), hidden_states, hidden_states))
        if isinstance(fc1, LoRALinear) and fc1.enabled and not fc1.merged_in_base(x_MK):
            if self.fused_weight is None:
                raise RuntimeError("GeluMLP: fused with a LoRA adapter on fc1 but refresh_fused() was not called")
            act = lora_linear_gelu_tanh(x_MK, fc1.lora_A[0], fc1.scaling, self.fused_weight, fc1.base.bias)
        else:
            base = fc1.base if isinstance(fc1, LoRALinear) else fc1
            weight = base.rollout_weight() if isinstance(base, RolloutLinear) else base.weight
            act = linear_gelu_tanh(x_MK, weight, base.bias)
        return self.linear_fc2(act.view(*hidden_states.shape[:-1], -1))

    # ---- the FP8 rollout (model_specs.common.fp8) --------------------------------------------------------------
    def _fp8_fusable(self) -> str:
        """'' when fc1 and fc2 both run FP8 and fc2's product is this rank's whole output (TP = 1: no reduction
        to run after it); else why not."""
        fc2 = self.linear_fc2
        base2 = fc2.base if isinstance(fc2, LoRALinear) else fc2
        if not uses_fp8(base2):
            return "fc1 runs its GEMM in FP8 (rollout.fp8) but fc2 does not: nothing to hand fc2 quantized"
        if base2.sequence_parallel or not base2.input_is_parallel or base2.tp_group.size() != 1 \
                or getattr(base2, "explicit_expert_comm", False):
            return "fc2 reduces its output over TP (or scatters its input): its FP8 product is not the whole output"
        return ""

    def _fp8_forward(self, inp: FP8Input):
        """MLP.forward with FP8 GEMMs, fc1's output handed to fc2 quantized: fc1's FP8 kernel on the quantized input
        (+ its LoRA output), then its bias, GELU-tanh and fc2's per-row quantization in one pass
        (``fp8.gelu_quantize_rows``: the unfused path reads fc1's output twice for the row maxima, then writes the
        activation and its FP8 copy), then fc2's FP8 kernel (+ its bias and LoRA output, as its forward adds them)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        x_MK = inp.rows()
        lora1 = isinstance(fc1, LoRALinear) and fc1.enabled and not fc1.merged_in_base(x_MK)
        lora2 = isinstance(fc2, LoRALinear) and fc2.enabled and not fc2.merged_in_base(x_MK)  # (act: x's rows)
        base1 = fc1.base if isinstance(fc1, LoRALinear) else fc1
        base2 = fc2.base if isinstance(fc2, LoRALinear) else fc2
        y_MN = base1.fp8_quantized_product(inp.q_MK, inp.scale_M1, x_MK.dtype)
        lora_in = fc1.low_rank(inp.x.reshape(x_MK.shape)) if lora1 else None
        act, q_MN, s_M1 = fp8.gelu_quantize_rows(y_MN, base1.bias, lora_in, lora2)
        out = base2.fp8_quantized_product(q_MN, s_M1, x_MK.dtype)
        bias = base2.bias if base2.skip_bias_add else None
        if not base2.skip_bias_add and base2.bias is not None:
            out = out + base2.bias
        if lora2:
            out = out + fc2.low_rank(act)
        return out.view(*inp.like.shape[:-1], -1), bias
