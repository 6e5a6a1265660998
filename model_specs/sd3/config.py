"""SD3 / SD3.5 MMDiT architecture, named as diffusers' ``SD3Transformer2DModel`` config.json names it.

Field names and defaults are diffusers' own (its class defaults: SD3-Medium 3.0), so a ``config.json`` loads with
:meth:`SD3Config.from_diffusers` and writes back unchanged; :func:`sd35_medium` and :func:`sd35_large` are the
published SD3.5 configs, :func:`tiny_config` the random-init shape tests use.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from model_specs.common.transformer_config import dit_transformer_config

DIFFUSERS_CLASS = "SD3Transformer2DModel"
QK_NORMS = (None, "rms_norm")  # SD3.0: none; SD3.5: per-head RMSNorm with a weight


@dataclass
class SD3Config:
    FAMILY: ClassVar[str] = "sd3"  # model_specs.family: the ModelFamily this arch belongs to

    sample_size: int = 128  # latent side the position table is centred for (base_size = sample_size / patch)
    patch_size: int = 2
    in_channels: int = 16  # VAE latent channels (the conv patch embedding's input)
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096  # text-embedding width (T5-XXL; CLIP states are zero-padded to it)
    caption_projection_dim: int = 1152  # context_embedder's output: the text stream's width (= hidden size)
    pooled_projection_dim: int = 2048  # CLIP-L + CLIP-G pooled outputs, concatenated
    out_channels: int = 16
    pos_embed_max_size: int = 96  # side of the 2-D sincos table the image grid is cropped from (centred)
    dual_attention_layers: tuple[int, ...] = ()  # MMDiT-X (3.5-Medium): blocks with the image-only attention
    qk_norm: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size  # diffusers FeedForward(mult=4)

    @property
    def in_features(self) -> int:
        """Channels of one packed latent token: a patch_size^2 patch of in_channels (``conditioning.pack``)."""
        return self.patch_size * self.patch_size * self.in_channels

    @property
    def out_features(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels

    def validate(self, tp: int = 1) -> None:
        """Raise ValueError naming the field that cannot work (at tensor-parallel size ``tp``)."""
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"SD3Config.qk_norm={self.qk_norm!r} is not supported; expected one of {QK_NORMS}")
        if self.caption_projection_dim != self.hidden_size:
            raise ValueError(f"caption_projection_dim={self.caption_projection_dim} must equal the hidden size "
                             f"num_attention_heads * attention_head_dim = {self.hidden_size}: the text stream of "
                             f"every joint block has the image stream's width")
        if self.hidden_size % 4:
            raise ValueError(f"hidden size {self.hidden_size} is not a multiple of 4; the 2-D sincos position table "
                             f"needs it")
        if bad := [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]:
            raise ValueError(f"dual_attention_layers {bad} are not block indices; expected values in "
                             f"[0, {self.num_layers})")
        if not isinstance(self.pos_embed_max_size, int) or self.pos_embed_max_size < 1:
            raise ValueError(f"pos_embed_max_size={self.pos_embed_max_size!r}; expected a positive int (the side of "
                             f"SD3's cropped position table; diffusers' uncropped variant without it is not ported)")
        if tp < 1 or self.num_attention_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide num_attention_heads="
                             f"{self.num_attention_heads}; expected a divisor of it")

    # ---- diffusers config.json <-> dataclass -------------------------------------------------
    @classmethod
    def from_diffusers(cls, cfg: dict[str, Any]) -> "SD3Config":
        """Build from a diffusers ``config.json`` dict; refuses other model classes and unknown keys."""
        cls_name = cfg.get("_class_name", DIFFUSERS_CLASS)
        if cls_name != DIFFUSERS_CLASS:
            raise ValueError(f"config.json is for {cls_name!r}; expected {DIFFUSERS_CLASS!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
        if unknown := sorted(set(kwargs) - known):
            raise ValueError(f"config.json has keys {unknown} unknown to {DIFFUSERS_CLASS}; expected a subset of "
                             f"{sorted(known)}")
        if kwargs.get("out_channels") is None:
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        kwargs["dual_attention_layers"] = tuple(kwargs.get("dual_attention_layers") or ())
        return cls(**kwargs)

    def to_diffusers(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dual_attention_layers"] = list(self.dual_attention_layers)
        return {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": "0.42.1", **d}

    # ---- megatron-core TransformerConfig --------------------------------------------------------
    def transformer_config(self, tp: int = 1, params_dtype: torch.dtype = torch.float32,
                           use_cpu_initialization: bool = True, **overrides: Any):
        """The megatron-core ``TransformerConfig`` the block specs are built with (as Qwen-Image's:
        ``use_cpu_initialization`` draws every full weight from one seeded generator, so a random-init model is
        the same at any TP size)."""
        self.validate(tp)
        return dit_transformer_config(num_layers=self.num_layers, hidden_size=self.hidden_size,
                                      num_attention_heads=self.num_attention_heads, kv_channels=self.attention_head_dim,
                                      ffn_hidden_size=self.ffn_hidden_size, tp=tp, qk_layernorm=self.qk_norm is not None,
                                      params_dtype=params_dtype, use_cpu_initialization=use_cpu_initialization,
                                      **overrides)


def sd35_medium(**overrides: Any) -> SD3Config:
    """stabilityai/stable-diffusion-3.5-medium's transformer/config.json (MMDiT-X: dual attention in 0..12)."""
    base = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
    return SD3Config(**{**base, **overrides})


def sd35_large(**overrides: Any) -> SD3Config:
    """stabilityai/stable-diffusion-3.5-large's transformer/config.json."""
    base = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, dual_attention_layers=(),
                qk_norm="rms_norm")
    return SD3Config(**{**base, **overrides})


def tiny_config(**overrides: Any) -> SD3Config:
    """The tiny random-init shape of tests: 3.5-Medium-like (dual attention in block 0, RMS q/k norm) by default;
    ``dual_attention_layers=()`` gives the 3.5-Large shape."""
    base = dict(sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16,
                num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=24,
                out_channels=16, pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
    return SD3Config(**{**base, **overrides})
