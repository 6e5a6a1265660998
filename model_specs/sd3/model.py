"""SD3 / SD3.5 MMDiT as a MegatronModule: embed -> joint blocks -> head.  Mirrors diffusers
``SD3Transformer2DModel`` in Megatron's [s, b, h] layout.

Inputs and outputs stay batch-first like the family protocol (model_specs.family): img_BIC [B, h * w,
patch^2 * in_channels] latent tokens packed by ``conditioning.pack``; txt_BTE [B, T, joint_attention_dim];
sigma_B [B] in [0, 1] (diffusers' timestep is 1000 sigma); text_mask_BT [B, T] bool or None (diffusers' SD3
attends to every text token: None, or all True, matches it); pooled_BP [B, pooled_projection_dim], the pooled
CLIP outputs that join the timestep embedding.  Returns the velocity [B, h * w, patch^2 * out_channels] in the
same token layout.

The patch embedding is diffusers' Conv2d(kernel = stride = patch) kept as the Conv2d's weight (the mapping table
copies it) and applied as the equivalent linear map over packed tokens; the cropped sincos position table
(``pos_embed_max_size``) is a persistent buffer, as in diffusers' checkpoints.

Context parallel (``cp_groups``) and pipeline parallel (``pre_process`` / ``post_process`` / ``layers``) follow
Qwen-Image's model (model_specs/qwen_image/model.py): image tokens split over CP with their position rows, text
whole; the timestep and pooled-text embedders replicated on every stage (``pipeline_parallel`` params).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_omni.parallel.linears import ColumnParallelLinear, RowParallelLinear
from megatron_omni.parallel.usp import ContextParallelGroups, gather_sequence
from model_specs.common.block_runner import BlockRunner
from model_specs.common.containers import MegatronModuleList
from model_specs.sd3.conditioning import (
    TIME_PROJ_DIM, SD3Conditioning, crop_positions, joint_attention_mask, position_table, timestep_sinusoid,
)
from model_specs.sd3.config import SD3Config
from model_specs.sd3.spec import NORM_EPS, sd3_block_spec


def _replicated(config: TransformerConfig, module: torch.nn.Module) -> torch.nn.Module:
    """A small layer kept whole on every TP rank, initialised like the parallel ones (same seed and order on every
    rank, so replicas start equal; their inputs are equal, so they stay equal)."""
    module = module.to(config.params_dtype)
    if config.perform_initialization:
        config.init_method(module.weight)
        torch.nn.init.zeros_(module.bias)
    return module


class SD3Model(MegatronModule):
    def __init__(self, arch: SD3Config, config: TransformerConfig, tp_group, block_spec: ModuleSpec | None = None,
                 *, cp_groups: ContextParallelGroups | None = None, pre_process: bool = True,
                 post_process: bool = True, layers: range | None = None):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules ask of a model
        self.share_embeddings_and_output_weights = False  # finalize_model_grads asks; a DiT ties nothing
        arch.validate(tp_group.size())
        self.arch, self.pre_process, self.post_process = arch, pre_process, post_process
        self.cp_groups = cp_groups if cp_groups is not None and cp_groups.cp > 1 else None
        self.layers = range(arch.num_layers) if layers is None else layers
        if self.cp_groups is not None and (arch.num_attention_heads // tp_group.size()) % self.cp_groups.ulysses:
            raise ValueError(f"num_attention_heads={arch.num_attention_heads} over tp={tp_group.size()} leaves "
                             f"{arch.num_attention_heads // tp_group.size()} heads per rank, which ulysses="
                             f"{self.cp_groups.ulysses} does not divide; expected tp*ulysses to divide the heads")
        hidden, dtype = arch.hidden_size, config.params_dtype
        block_spec = block_spec or sd3_block_spec("auto", arch.qk_norm is not None, self.cp_groups is not None)
        # time_text_embed: timestep_embedder and text_embedder, Linear -> SiLU -> Linear each, split over TP
        self.time_linear_1, self.time_linear_2 = self._embedder(TIME_PROJ_DIM, tp_group)
        self.pooled_linear_1, self.pooled_linear_2 = self._embedder(arch.pooled_projection_dim, tp_group)
        if pre_process:
            patch = arch.patch_size
            self.patch_embed = _replicated(config, torch.nn.Conv2d(arch.in_channels, hidden, patch, stride=patch))
            table = position_table(hidden, arch.pos_embed_max_size, arch.sample_size // patch)
            self.register_buffer("pos_embed", table.to(dtype)[None], persistent=True)
            self.context_embedder = _replicated(
                config, torch.nn.Linear(arch.joint_attention_dim, arch.caption_projection_dim))
        # children named by GLOBAL block index ("blocks.7.*" on any stage), as in Qwen-Image
        self.blocks = MegatronModuleList(config, ())
        for i in self.layers:
            self.blocks.add_module(str(i), build_module(
                block_spec, config=config, layer_number=i + 1, tp_group=tp_group, cp_groups=self.cp_groups,
                dual_attention=i in arch.dual_attention_layers, context_pre_only=i == arch.num_layers - 1))
        if post_process:
            # norm_out (AdaLayerNormContinuous): LayerNorm without affine, modulated by Linear(H, 2H) -> (scale, shift)
            self.norm_out_linear = _replicated(config, torch.nn.Linear(hidden, 2 * hidden))
            self.norm_out = torch.nn.LayerNorm(hidden, eps=NORM_EPS, elementwise_affine=False)
            self.proj_out = _replicated(config, torch.nn.Linear(hidden, arch.out_features))
        self.input_tensor = None
        self.block_runner = BlockRunner()  # megatron_omni.compile.compile_blocks swaps in a compiled one

    def _embedder(self, n_in: int, tp_group) -> tuple[ColumnParallelLinear, RowParallelLinear]:
        config, hidden = self.config, self.arch.hidden_size
        first = ColumnParallelLinear(n_in, hidden, config=config, init_method=config.init_method, bias=True,
                                     gather_output=False, tp_group=tp_group)
        second = RowParallelLinear(hidden, hidden, config=config, bias=True, input_is_parallel=True,
                                   init_method=config.output_layer_init_method, skip_bias_add=False,
                                   tp_group=tp_group)
        first.per_sample = second.per_sample = True  # (never FP8: RolloutLinear)
        for p in (*first.parameters(), *second.parameters()):
            p.pipeline_parallel = True  # replicated on every stage: finalize_model_grads sums over PP
            p.shared = not self.pre_process  # ... and counted once in the grad norm: on the first stage
        return first, second

    def set_input_tensor(self, input_tensor) -> None:
        """megatron-core's schedules hand a non-first stage the previous stage's output here."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"an SD3 stage receives one tensor, got {len(input_tensor)}")
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

    def _temb(self, sigma_B: torch.Tensor, pooled_BP: torch.Tensor) -> torch.Tensor:
        """CombinedTimestepTextProjEmbeddings: timestep MLP (sinusoids rounded to the model dtype) + pooled MLP."""
        dtype = self.time_linear_2.weight.dtype
        t_BD = self.time_linear_2(F.silu(self.time_linear_1(timestep_sinusoid(sigma_B).to(dtype))[0]))[0]
        p_BD = self.pooled_linear_2(F.silu(self.pooled_linear_1(pooled_BP.to(dtype))[0]))[0]
        return t_BD + p_BD

    def _embed_image(self, img_BIC: torch.Tensor, img_fhw: tuple[int, int, int], chunk: slice) -> torch.Tensor:
        """PatchEmbed on this rank's packed tokens (``chunk``): the conv as a linear map over (patch row, column,
        channel), plus the centred crop of the position table; [I, B, H]."""
        conv = self.patch_embed
        weight_DK = conv.weight.permute(0, 2, 3, 1).reshape(conv.weight.shape[0], -1)
        pos_ID = crop_positions(self.pos_embed, self.arch.pos_embed_max_size, img_fhw[1], img_fhw[2])[chunk]
        return (F.linear(img_BIC[:, chunk], weight_DK, conv.bias) + pos_ID).transpose(0, 1)

    def forward(self, img_BIC: torch.Tensor, txt_BTE: torch.Tensor, sigma_B: torch.Tensor,
                img_fhw: tuple[int, int, int], text_mask_BT: torch.Tensor | None = None,
                pooled_BP: torch.Tensor | None = None) -> torch.Tensor:
        _check_inputs(self.arch, img_BIC, txt_BTE, sigma_B, img_fhw, text_mask_BT, pooled_BP)
        text_len, chunk = txt_BTE.shape[1], self._image_chunk(img_BIC.shape[1])
        cond = SD3Conditioning(temb_BD=self._temb(sigma_B, pooled_BP), text_len=text_len,
                               attn_mask_B11S=joint_attention_mask(text_mask_BT, chunk.stop - chunk.start))
        if self.pre_process:
            txt_TBH = self.context_embedder(txt_BTE).transpose(0, 1)
            hidden_SBH = torch.cat([txt_TBH, self._embed_image(img_BIC, img_fhw, chunk)], dim=0)
        else:
            hidden_SBH = self.input_tensor
        hidden_SBH = self.block_runner(list(self.blocks), hidden_SBH, cond, [None] * len(self.layers))
        if not self.post_process:
            return hidden_SBH
        scale_BH, shift_BH = self.norm_out_linear(F.silu(cond.temb_BD)).chunk(2, dim=-1)
        img_IBH = self.norm_out(hidden_SBH[text_len:]) * (1 + scale_BH[None]) + shift_BH[None]
        out_IBC = self.proj_out(img_IBH)
        if self.cp_groups is not None:
            out_IBC = gather_sequence(out_IBC, self.cp_groups.cp_group)
        return out_IBC.transpose(0, 1)


def _check_inputs(arch: SD3Config, img_BIC, txt_BTE, sigma_B, img_fhw, text_mask_BT, pooled_BP) -> None:
    """Shape errors a caller can make, reported in the caller's terms (not from deep inside a matmul)."""
    b = img_BIC.shape[0]
    if len(img_fhw) != 3 or img_fhw[0] != 1:
        raise ValueError(f"img_fhw={tuple(img_fhw)}; SD3 denoises single images: expected (1, h, w) tokens")
    n_img = img_fhw[1] * img_fhw[2]
    if img_BIC.dim() != 3 or img_BIC.shape[1:] != (n_img, arch.in_features):
        raise ValueError(f"image tokens have shape {tuple(img_BIC.shape)}; expected [B, {n_img}, {arch.in_features}] "
                         f"for img_fhw={tuple(img_fhw)}")
    if txt_BTE.dim() != 3 or txt_BTE.shape[0] != b or txt_BTE.shape[2] != arch.joint_attention_dim:
        raise ValueError(f"text embeddings have shape {tuple(txt_BTE.shape)}; expected [{b}, T, "
                         f"{arch.joint_attention_dim}]")
    if tuple(sigma_B.shape) != (b,):
        raise ValueError(f"timesteps have shape {tuple(sigma_B.shape)}; expected [{b}]")
    if text_mask_BT is not None and tuple(text_mask_BT.shape) != tuple(txt_BTE.shape[:2]):
        raise ValueError(f"text mask has shape {tuple(text_mask_BT.shape)}; expected {tuple(txt_BTE.shape[:2])}")
    if pooled_BP is None or tuple(pooled_BP.shape) != (b, arch.pooled_projection_dim):
        got = None if pooled_BP is None else tuple(pooled_BP.shape)
        raise ValueError(f"pooled text embeddings {got}; expected pooled_BP of shape [{b}, "
                         f"{arch.pooled_projection_dim}] (the pooled CLIP outputs SD3's adaLN takes)")
