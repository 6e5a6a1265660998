"""Qwen-Image MMDiT as a MegatronModule: embed -> blocks -> head.  Mirrors diffusers
``QwenImageTransformer2DModel`` (base variant) in Megatron's [s, b, h] layout.

Inputs and outputs stay batch-first like diffusers so samplers and rewards need not care:
img_BIC [B, S_I, in_channels] (2x2-packed latents), txt_BTE [B, S_T, joint_attention_dim],
sigma_B [B] in [0, 1], text_mask_BT [B, S_T] bool (True = real token) or None.
Returns the velocity [B, S_I, patch^2 * out_channels].

Context parallel (``cp_groups``): every CP rank gets the whole sample, embeds only its 1/cp chunk of the
image tokens (with the matching RoPE rows), keeps the text tokens whole, runs the blocks with USP core
attention, and gathers the velocity over the CP group at the end (gradient: this rank's chunk only).
Pipeline parallel: a stage holds the blocks ``layers`` (global indices, so parameter names are
``blocks.{i}`` at any PP); ``pre_process`` stages embed text and image, ``post_process`` stages own the
output head; the timestep embedder is replicated on every stage (its gradients are all-reduced over the
pipeline group by megatron's ``finalize_model_grads``: params flagged ``pipeline_parallel`` and
``config.has_cond_embedder``).  A non-last stage returns the joint hidden cat([text, image]) [S, B, H].
"""
from __future__ import annotations

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from model_specs.common.block_runner import BlockRunner
from model_specs.common.containers import MegatronModuleList
from model_specs.qwen_image.conditioning import (
    TIME_PROJ_DIM, ModulationTable, QwenImageConditioning, joint_attention_mask, rope_freqs, timestep_sinusoid,
)
from model_specs.qwen_image.config import QwenImageConfig
from model_specs.qwen_image.spec import NORM_EPS, qwen_image_block_spec
from megatron_omni.parallel.linears import ColumnParallelLinear, RowParallelLinear
from megatron_omni.parallel.usp import ContextParallelGroups, gather_sequence


def _replicated_linear(config: TransformerConfig, n_in: int, n_out: int) -> torch.nn.Linear:
    """A small linear kept whole on every TP rank, initialised like the parallel ones (same seed
    and order on every rank, so replicas start equal; their inputs are equal, so they stay equal)."""
    layer = torch.nn.Linear(n_in, n_out, dtype=config.params_dtype)
    if config.perform_initialization:
        config.init_method(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    return layer


class QwenImageModel(MegatronModule):
    def __init__(self, arch: QwenImageConfig, config: TransformerConfig, tp_group,
                 block_spec: ModuleSpec | None = None, *, cp_groups: ContextParallelGroups | None = None,
                 pre_process: bool = True, post_process: bool = True, layers: range | None = None):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules ask of a model
        # finalize_model_grads asks every first/last stage whether an LM-style word embedding is tied
        # to the output layer (to all-reduce it); a DiT has none
        self.share_embeddings_and_output_weights = False
        arch.validate(tp_group.size())
        self.arch, self.pre_process, self.post_process = arch, pre_process, post_process
        self.cp_groups = cp_groups if cp_groups is not None and cp_groups.cp > 1 else None
        self.layers = range(arch.num_layers) if layers is None else layers
        if self.cp_groups is not None and (arch.num_attention_heads // tp_group.size()) % self.cp_groups.ulysses:
            raise ValueError(f"num_attention_heads={arch.num_attention_heads} over tp={tp_group.size()} leaves "
                             f"{arch.num_attention_heads // tp_group.size()} heads per rank, which ulysses="
                             f"{self.cp_groups.ulysses} does not divide; expected tp*ulysses to divide the heads")
        hidden = arch.hidden_size
        block_spec = block_spec or qwen_image_block_spec("auto", context_parallel=self.cp_groups is not None)
        # time_text_embed.timestep_embedder: Linear(256, H) -> SiLU -> Linear(H, H), split over TP
        self.time_linear_1 = ColumnParallelLinear(TIME_PROJ_DIM, hidden, config=config, init_method=config.init_method,
                                                  bias=True, gather_output=False, tp_group=tp_group)
        self.time_linear_2 = RowParallelLinear(hidden, hidden, config=config, bias=True, input_is_parallel=True,
                                               init_method=config.output_layer_init_method, skip_bias_add=False,
                                               tp_group=tp_group)
        self.time_linear_1.per_sample = self.time_linear_2.per_sample = True  # (never FP8: RolloutLinear)
        for p in (*self.time_linear_1.parameters(), *self.time_linear_2.parameters()):
            p.pipeline_parallel = True  # replicated on every stage: finalize_model_grads sums over PP
            # ... and counted once in the grad norm (megatron skips `shared` params there): on the first stage
            p.shared = not pre_process
        if pre_process:
            self.txt_norm = torch.nn.RMSNorm(arch.joint_attention_dim, eps=NORM_EPS, dtype=config.params_dtype)
            self.txt_in = _replicated_linear(config, arch.joint_attention_dim, hidden)
            self.img_in = _replicated_linear(config, arch.in_channels, hidden)
        # children named by GLOBAL block index ("blocks.7.*" on any stage): checkpoints and the mapping
        # table see the same names at every PP size
        self.blocks = MegatronModuleList(config, ())
        for i in self.layers:
            self.blocks.add_module(str(i), build_module(block_spec, config=config, layer_number=i + 1,
                                                        tp_group=tp_group, cp_groups=self.cp_groups))
        if post_process:
            # norm_out (AdaLayerNormContinuous): LayerNorm without affine, modulated by Linear(H, 2H) -> (scale, shift)
            self.norm_out_linear = _replicated_linear(config, hidden, 2 * hidden)
            self.norm_out = torch.nn.LayerNorm(hidden, eps=NORM_EPS, elementwise_affine=False)
            self.proj_out = _replicated_linear(config, hidden, arch.out_features)
        self.input_tensor = None
        # runs the blocks, a slice per call; megatron_omni.compile.compile_blocks swaps in a compiled one
        self.block_runner = BlockRunner()

    def set_input_tensor(self, input_tensor) -> None:
        """megatron-core's schedules hand a non-first stage the previous stage's output here."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"a Qwen-Image stage receives one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _image_chunk(self, image_len: int) -> slice:
        """This CP rank's image tokens (all of them without CP)."""
        if self.cp_groups is None:
            return slice(0, image_len)
        cp = self.cp_groups.cp
        if image_len % cp:
            raise ValueError(f"{image_len} image tokens do not split over context-parallel size cp={cp}; "
                             f"expected a multiple of {cp} (choose the resolution or cp accordingly)")
        n = image_len // cp
        return slice(self.cp_groups.cp_rank * n, (self.cp_groups.cp_rank + 1) * n)

    def _temb(self, sigma_B: torch.Tensor) -> torch.Tensor:
        dtype = self.time_linear_2.weight.dtype
        sinus_BF = timestep_sinusoid(sigma_B, dtype=dtype).to(dtype)
        return self.time_linear_2(torch.nn.functional.silu(self.time_linear_1(sinus_BF)[0]))[0]

    def conditioning(self, sigma_B: torch.Tensor, img_fhw: tuple[int, int, int], text_len: int,
                     text_mask_BT: torch.Tensor | None, temb: torch.Tensor | None = None) -> QwenImageConditioning:
        """``temb``: the timestep embedding when already known (a modulation table's), else computed from sigma."""
        img_freqs, txt_freqs = rope_freqs(img_fhw, text_len, self.arch.axes_dims_rope, self.arch.rope_theta,
                                          device=sigma_B.device)
        chunk = self._image_chunk(img_fhw[0] * img_fhw[1] * img_fhw[2])
        img_freqs = img_freqs[chunk]
        return QwenImageConditioning(temb_BH=self._temb(sigma_B) if temb is None else temb, txt_freqs=txt_freqs,
                                     img_freqs=img_freqs,
                                     attn_mask_B11S=joint_attention_mask(text_mask_BT, img_freqs.shape[0]),
                                     text_len=text_len)

    def modulation_table(self, sigma_N: torch.Tensor) -> ModulationTable:
        """Every adaLN modulation of this stage at the N sigmas (conditioning.ModulationTable); a forward given
        ``modulation=table.step(n)`` reads them instead of computing them.  Inference only (under no_grad)."""
        if torch.is_grad_enabled():
            raise RuntimeError("modulation_table is for inference (a rollout): build it under torch.no_grad(); "
                               "training computes the modulation in the forward, where its weights get gradients")
        temb_NH = self._temb(sigma_N)
        act_NH = torch.nn.functional.silu(temb_NH)
        blocks = {i: (block.img_mod(act_NH)[0], block.txt_mod(act_NH)[0]) for i, block in zip(self.layers, self.blocks)}
        return ModulationTable(temb_NH, blocks, self.norm_out_linear(act_NH) if self.post_process else None)

    def forward(self, img_BIC: torch.Tensor, txt_BTE: torch.Tensor, sigma_B: torch.Tensor,
                img_fhw: tuple[int, int, int], text_mask_BT: torch.Tensor | None = None,
                modulation: ModulationTable | None = None) -> torch.Tensor:
        """``modulation``: ``self.modulation_table(sigmas).step(n)`` when every row is at sigmas[n] (the caller's
        promise: sigma_B is not read back to check it), under no_grad; None: computed here from sigma_B."""
        _check_inputs(self.arch, img_BIC, txt_BTE, sigma_B, img_fhw, text_mask_BT)
        if modulation is not None and (len(modulation.temb_NH) != 1 or torch.is_grad_enabled()):
            raise ValueError(f"modulation of {len(modulation.temb_NH)} timesteps with grad "
                             f"{'enabled' if torch.is_grad_enabled() else 'disabled'}; expected one timestep "
                             f"(table.step(n)) under torch.no_grad()")
        cond = self.conditioning(sigma_B, img_fhw, txt_BTE.shape[1], text_mask_BT,
                                 None if modulation is None else modulation.temb_NH)
        if self.pre_process:
            txt_TBH = self.txt_in(self.txt_norm(txt_BTE)).transpose(0, 1)
            img_IBH = self.img_in(img_BIC[:, self._image_chunk(img_BIC.shape[1])]).transpose(0, 1)
            hidden_SBH = torch.cat([txt_TBH, img_IBH], dim=0)
        else:
            hidden_SBH = self.input_tensor
        hidden_SBH = self.block_runner(list(self.blocks), hidden_SBH, cond,
                                       [None if modulation is None else modulation.blocks[i] for i in self.layers])
        if not self.post_process:
            return hidden_SBH
        img_IBH = hidden_SBH[cond.text_len:]
        out_mod = self.norm_out_linear(torch.nn.functional.silu(cond.temb_BH)) if modulation is None \
            else modulation.out_N2H
        scale_BH, shift_BH = out_mod.chunk(2, dim=-1)
        img_IBH = self.norm_out(img_IBH) * (1 + scale_BH[None]) + shift_BH[None]
        out_IBC = self.proj_out(img_IBH)
        if self.cp_groups is not None:
            out_IBC = gather_sequence(out_IBC, self.cp_groups.cp_group)
        return out_IBC.transpose(0, 1)


def _check_inputs(arch: QwenImageConfig, img_BIC, txt_BTE, sigma_B, img_fhw, text_mask_BT) -> None:
    """Shape errors a caller can make, reported in the caller's terms (not from deep inside a matmul)."""
    b = img_BIC.shape[0]
    n_img = img_fhw[0] * img_fhw[1] * img_fhw[2]
    if img_BIC.dim() != 3 or img_BIC.shape[1:] != (n_img, arch.in_channels):
        raise ValueError(f"image tokens have shape {tuple(img_BIC.shape)}; expected [B, {n_img}, {arch.in_channels}] "
                         f"for img_fhw={tuple(img_fhw)}")
    if txt_BTE.dim() != 3 or txt_BTE.shape[0] != b or txt_BTE.shape[2] != arch.joint_attention_dim:
        raise ValueError(f"text embeddings have shape {tuple(txt_BTE.shape)}; expected [{b}, S_T, "
                         f"{arch.joint_attention_dim}]")
    if tuple(sigma_B.shape) != (b,):
        raise ValueError(f"timesteps have shape {tuple(sigma_B.shape)}; expected [{b}]")
    if text_mask_BT is not None and tuple(text_mask_BT.shape) != tuple(txt_BTE.shape[:2]):
        raise ValueError(f"text mask has shape {tuple(text_mask_BT.shape)}; expected {tuple(txt_BTE.shape[:2])}")
