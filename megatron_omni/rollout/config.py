"""The rollout engine's settings, declared once: the run config's ``rollout`` section extends this class, and
the loop hands that section to the engine as it is (``megatron_omni.config.schema.RolloutConfig``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # requests per forward (CFG doubles the rows)
    wait_ms: float = 5.0  # how long submit() lets a batch fill before running it
    # each prompt's text is padded to a multiple of this (cond and negative prompt apart), so that requests share a
    # batch only at one shape and batching never changes a sample; 1 = real tokens only: no padding, so no
    # attention mask (a masked SDPA forward was 1.6x slower than the unmasked one at the rollout's batch 32 on
    # an H200, bench/RESULTS.md); larger values let prompts of near lengths share a batch
    text_pad_multiple: int = 1
    # inference fusions (model_specs.common.fusion): fc1's bias + GELU in the GEMM epilogue (fc1's LoRA folded
    # into that GEMM), q / k norm + RoPE + joint layout in one kernel; modules that cannot fuse keep their path;
    # false = the model's plain forward (the trainer's math, op for op)
    fuse: bool = True
    # the per-token GEMMs in float8 e4m3 with per-row scales (model_specs.common.fp8: torch._scaled_mm on an sm89+
    # GPU, a float32 emulation of it elsewhere); training stays in the model dtype and recomputes pi_old itself
    # (the rollout's log-probs are then logged against the trainer's, not trained on)
    fp8: bool = False
    # with fp8 on a GPU: the FP8 GEMMs accumulate with the tensor cores' fast accumulation (``torch._scaled_mm``'s
    # use_fast_accum; Transformer Engine's choice for forward GEMMs), false = promoted (split) accumulation, slower
    # and closer to float32; the CPU emulation accumulates in float32 either way
    fp8_fast_accum: bool = True
    # with fp8 and fuse: a block's LayerNorm + modulation (+ the gated residual before its MLP) writes its QKV and
    # fc1 GEMMs' e4m3 input and row scales in one Triton pass per stream (model_specs.common.norm_quantize), instead
    # of inductor's reductions over the row; Qwen-Image blocks (others keep the handoff); on by default: the FP8 step's
    # sampling phase −7.9 % on an H100 (30 blocks, alternating A/B, bench/RESULTS.md); false = inductor's fusion
    fp8_adaln_kernel: bool = True
    # a LoRA engine's adapters: merged = each adapted linear's rollout weight is W + s·B·A (rebuilt at each weight
    # change; one GEMM instead of the base's and the adapter's skinny two: model_specs.common.rollout_linear;
    # without FP8 a model-dtype copy of the adapted weights while the rollout runs), whose rounding differs from the
    # trainer's, which then recomputes pi_old itself as with fp8; separate = the base and the adapter apart, the
    # trainer's op sequence; auto = merged on an accelerator (the trainer resolves it: merged when the memory
    # estimate with the copies fits the device), separate on a CPU
    lora_weights: Literal["auto", "merged", "separate"] = "auto"
    # under rollout.compile: a batch's first denoising step runs with torch.compile's full guard checks (compiling
    # what it must) and the later steps, whose inputs have that step's shapes, dtypes and flags, check only the guards
    # that tell the compiled graphs apart (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``): the guard
    # evaluation is host work at each of the 60 blocks' calls per forward; false = full checks at every step
    skip_repeat_guards: bool = True
    # on a CUDA device whose forwards no other rank joins (TP = CP = 1): a batch's denoiser forward is captured
    # into a CUDA graph at its second denoising step and replayed at the later ones (one graph per forward layout,
    # e.g. the cond and the negative prompt's; megatron_omni.rollout.graphs), so those steps launch no kernel from
    # the host; the graphs' memory pool holds one forward's activations while the batch runs. No effect elsewhere
    cuda_graphs: bool = False

    def check_engine(self) -> None:
        """Raise ValueError naming the engine setting that cannot work."""
        for name, value, lowest in (("max_num_seqs", self.max_num_seqs, 1),
                                    ("text_pad_multiple", self.text_pad_multiple, 1)):
            if not isinstance(value, int) or value < lowest:
                raise ValueError(f"{name}: expected an integer >= {lowest}, got {value!r}")
        if self.lora_weights not in ("auto", "merged", "separate"):
            raise ValueError(f"lora_weights: expected 'auto', 'merged' or 'separate', got {self.lora_weights!r}")
        if not self.wait_ms >= 0:
            raise ValueError(f"wait_ms: expected >= 0 milliseconds, got {self.wait_ms!r}")

    def merges_lora(self, device: str) -> bool:
        """``lora_weights`` resolved for an engine on ``device`` (its type: "cpu", "cuda", "npu")."""
        return self.lora_weights == "merged" or (self.lora_weights == "auto" and device != "cpu")
