"""Qwen-Image MMDiT architecture, named as diffusers' ``QwenImageTransformer2DModel`` config.json names it.

The field names and defaults are the diffusers ones (full-size Qwen-Image), so a diffusers
``config.json`` loads with :meth:`QwenImageConfig.from_diffusers` and writes back unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from model_specs.common.transformer_config import dit_transformer_config

DIFFUSERS_CLASS = "QwenImageTransformer2DModel"


@dataclass
class QwenImageConfig:
    FAMILY: ClassVar[str] = "qwen_image"  # model_specs.family: the ModelFamily this arch belongs to

    patch_size: int = 2
    in_channels: int = 64  # 2x2-packed latent channels (16 VAE channels x 4)
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584  # text-encoder width (Qwen2.5-VL 7B)
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)  # (frame, height, width); sums to head dim
    rope_theta: int = 10000
    # Variants of the diffusers class that this port does not implement; kept so that a config.json
    # using them is refused with a clear message instead of silently ignored.
    guidance_embeds: bool = False
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size  # diffusers FeedForward(mult=4)

    @property
    def out_features(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels

    def validate(self, tp: int = 1) -> None:
        """Raise ValueError naming the field that cannot work (at tensor-parallel size ``tp``)."""
        for name in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if getattr(self, name):
                raise ValueError(f"QwenImageConfig.{name}=True is not supported (only the base Qwen-Image "
                                 f"architecture is implemented); expected False")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope={tuple(self.axes_dims_rope)} sums to {sum(self.axes_dims_rope)}; "
                             f"expected attention_head_dim={self.attention_head_dim}")
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope={tuple(self.axes_dims_rope)}: every axis must be even")
        if tp < 1 or self.num_attention_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide num_attention_heads="
                             f"{self.num_attention_heads}; expected a divisor of it")

    # ---- diffusers config.json <-> dataclass -------------------------------------------------
    @classmethod
    def from_diffusers(cls, cfg: dict[str, Any]) -> "QwenImageConfig":
        """Build from a diffusers ``config.json`` dict; refuses other model classes and unknown keys."""
        cls_name = cfg.get("_class_name", DIFFUSERS_CLASS)
        if cls_name != DIFFUSERS_CLASS:
            raise ValueError(f"config.json is for {cls_name!r}; expected {DIFFUSERS_CLASS!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"config.json has keys {unknown} unknown to {DIFFUSERS_CLASS}; expected a subset of "
                             f"{sorted(known - {'rope_theta'})}")
        if kwargs.get("out_channels") is None:
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        if "axes_dims_rope" in kwargs:
            kwargs["axes_dims_rope"] = tuple(kwargs["axes_dims_rope"])
        return cls(**kwargs)

    def to_diffusers(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("rope_theta")  # fixed at 10000 in diffusers, not a config key
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": "0.42.1", **d}

    # ---- megatron-core TransformerConfig --------------------------------------------------------
    def transformer_config(self, tp: int = 1, params_dtype: torch.dtype = torch.float32,
                           use_cpu_initialization: bool = True, **overrides: Any):
        """The megatron-core ``TransformerConfig`` the block specs are built with.

        ``use_cpu_initialization`` makes every TP rank draw the full weight from one seeded CPU
        generator and keep its slice, so a random-init model is the same at any TP size.
        """
        self.validate(tp)
        return dit_transformer_config(num_layers=self.num_layers, hidden_size=self.hidden_size,
                                      num_attention_heads=self.num_attention_heads, kv_channels=self.attention_head_dim,
                                      ffn_hidden_size=self.ffn_hidden_size, tp=tp, qk_layernorm=True,
                                      params_dtype=params_dtype, use_cpu_initialization=use_cpu_initialization,
                                      **overrides)


def tiny_config(**overrides: Any) -> QwenImageConfig:
    """The tiny random-init configuration used by tests and the demo (1.29 M params in diffusers)."""
    base = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
                num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(8, 12, 12))
    base.update(overrides)
    return QwenImageConfig(**base)

