"""``ModelFamily``: everything generic code (rollout, sync, trainer, algorithms, config, the convert CLI) may ask
a model family, and the registry of families by name.

A family is one folder ``model_specs/<name>/`` (config, spec, model, conditioning, flops, ``family.py`` holding
its ``ModelFamily`` subclass) plus its mapping table ``checkpoints_convert/<name>.py``, and one line in
``FAMILIES`` below.  Generic code never imports a family by name: it asks ``family_of(arch)`` (every family's
arch config class names its family in ``FAMILY``), ``get_family(name)`` or ``family_for_class(_class_name)``
(a diffusers folder's transformer or pipeline class).  tests/test_family_imports.py walks the imports.

The denoiser protocol the engine and the losses rely on: ``model(x_BIC, txt_BTE, sigma_B, img_fhw, txt_mask_BT,
**step_inputs)`` returns the velocity [B, I, C_out] for packed latent tokens x at σ (t = σ ∈ [0, 1]) and
``step_inputs(model, sigmas_N)`` gives per-step keyword arguments computed once per rollout batch (a family
without such a cache returns empty dicts).  Shape legend: B rows, I image tokens, C channels, T text tokens,
E text width, N sampling steps.

Text conditioning besides the token embeddings (SD3's pooled CLIP outputs): a family's ``encode(prompts)`` may
return ``(emb, mask, extras)`` where ``extras`` maps a keyword argument of the denoiser to a tensor [N, ...] with
one row per prompt; the engine and the trainer keep each prompt's rows with its text and pass them, stacked per
batch row like the text, as keyword arguments.  A family without such inputs returns ``(emb, mask)``
(:func:`split_encoding` reads both forms).
"""
from __future__ import annotations

import importlib
from typing import Any, Sequence

import torch

TextExtras = dict[str, torch.Tensor]  # denoiser keyword -> [N, ...] one row per prompt (per row once batched)

# name -> module holding FAMILY, a ModelFamily instance; one line per family
FAMILIES = {
    "qwen_image": "model_specs.qwen_image.family",
    "sd3": "model_specs.sd3.family",
}


def split_encoding(encoded) -> tuple[torch.Tensor, torch.Tensor, TextExtras]:
    """(emb [N, T, E], mask [N, T], extras) of what a family's ``encode`` returned: ``(emb, mask)`` or ``(emb, mask,
    extras)``; ValueError naming an extra whose rows do not match the prompts."""
    if not isinstance(encoded, (tuple, list)) or len(encoded) not in (2, 3):
        raise ValueError(f"a text encoder returned {type(encoded).__name__}; expected (emb, mask) or (emb, mask, "
                         f"extras)")
    emb, mask, extras = (*encoded, {}) if len(encoded) == 2 else encoded
    for name, t in extras.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != emb.shape[0]:
            raise ValueError(f"text extra {name!r} has shape {getattr(t, 'shape', None)}; expected one row per "
                             f"prompt, [{emb.shape[0]}, ...]")
    return emb, mask, dict(extras)


def stack_extras(rows: Sequence[TextExtras | None]) -> TextExtras:
    """Per-row extras (each {name: [...]}, one per batch row) stacked to {name: [B, ...]}; every row must carry the
    same names (one family); {} when none carries any."""
    rows = [r or {} for r in rows]
    names = set(rows[0]) if rows else set()
    if any(set(r) != names for r in rows):
        raise ValueError(f"rows of one batch carry different text extras {sorted({tuple(sorted(r)) for r in rows})}; "
                         f"expected the same names on every row")
    return {n: torch.stack([r[n] for r in rows]) for n in sorted(names)}


class ModelFamily:
    """Base class of a family's answers; each method says what generic code uses it for."""

    name: str = ""
    arch_class: type = object  # the family's arch config dataclass (its FAMILY class attribute == name)
    transformer_class: str = ""  # diffusers ``_class_name`` of the denoiser's folder
    pipeline_classes: tuple[str, ...] = ()  # diffusers pipeline ``_class_name``s whose folders it loads
    edit_pipeline_classes: tuple[str, ...] = ()  # those of them that edit a source image (``pipeline(...).edit``)
    guidance_rescale: str | None = None  # CFG rule (rollout.samplers.cfg_combine): "token", "sample" or None
    # generate's CFG rule: True as QwenImagePipeline (true CFG only with a negative prompt and scale > 1); False as
    # StableDiffusion3Pipeline (CFG whenever guidance > 1, the negative prompt "" when none is given)
    cfg_needs_negative_prompt: bool = True
    experts: tuple[str, ...] = ("transformer",)  # denoisers of one pipeline (Wan2.2 A14B: two, by sigma)

    # ---- arch config ------------------------------------------------------------------------------------
    def default_arch(self):
        raise NotImplementedError

    def arch_from_config(self, config: dict[str, Any]):
        """The arch from a diffusers/transformers ``config.json`` dict; ValueError naming a bad key."""
        raise NotImplementedError

    def arch_to_config(self, arch) -> dict[str, Any]:
        raise NotImplementedError

    def check_layout(self, arch, tp: int = 1, ulysses: int = 1, pipeline_chunks: int = 1) -> None:
        """ValueError naming the arch field a layout cannot split (heads over tp x ulysses, blocks over chunks)."""
        raise NotImplementedError

    def num_blocks(self, arch) -> int:
        raise NotImplementedError

    def num_heads(self, arch) -> int:
        """Attention heads: how fused QKV tensors split (mapping table) and what TP / Ulysses divide."""
        raise NotImplementedError

    def text_dim(self, arch) -> int:
        """Width E of the text embeddings the denoiser takes."""
        raise NotImplementedError

    def latent_channels(self, arch) -> int:
        """Channels C of one packed latent token: the denoiser's input and its velocity output."""
        raise NotImplementedError

    # ---- building -----------------------------------------------------------------------------------------
    def transformer_config(self, arch, tp: int = 1, params_dtype: torch.dtype = torch.float32, **overrides):
        """megatron-core's TransformerConfig of the denoiser at tensor-parallel size ``tp``."""
        raise NotImplementedError

    def build(self, arch, config, tp_group, backend: str = "local", *, cp_groups=None, pre_process: bool = True,
              post_process: bool = True, layers: Sequence[int] | None = None) -> torch.nn.Module:
        """The denoiser (or one pipeline stage of it: ``layers`` by global index) at ``config``'s layout."""
        raise NotImplementedError

    def step_inputs(self, model: torch.nn.Module, sigmas_N: torch.Tensor) -> list[dict[str, Any]]:
        """Per sampling step, keyword arguments of the denoiser computed once per rollout batch."""
        return [{} for _ in range(len(sigmas_N))]

    # ---- pipeline folders ---------------------------------------------------------------------------------
    def pipeline(self, path, dtype: torch.dtype = torch.float32, device="cpu"):
        """The parts of a diffusers pipeline folder around the denoiser, an object with: ``transformer_dir``;
        ``encode(prompts) -> (emb [N, T, E], mask [N, T])`` as the pipeline encodes them (or ``(emb, mask, extras)``
        with further denoiser inputs per prompt, see the module docstring); ``latent_grid(height,
        width) -> img_fhw``; ``decode(latents [N, I, C], img_fhw) -> images [N, 3, H, W] in [0, 1]``;
        ``unpack(latents [N, I, C], img_fhw) -> [N, Z, h, w]`` (the latent image, no VAE: latent rewards read it);
        ``sigmas(num_steps, img_fhw) -> [num_steps + 1]`` (the scheduler's shift); ``noise(generator, img_fhw)
        -> [I, C]`` (initial latents as the pipeline draws them).  ValueError naming a folder of another class
        or a missing component.  ``edit``: True for an image-edit pipeline, whose parts also give
        ``edit_inputs(image) -> (img_fhw, context [S_c, C], resized image)`` (the output's token grid, the source
        image's latent tokens that follow the sampled ones in every forward as ``Request.context_latents``, the
        image the text encoder takes) and ``encode_edit(prompts, images) -> (emb, mask)``; ``encode`` is then
        not for use."""
        raise ValueError(f"model family {self.name!r} loads no pipeline folders yet")

    # ---- names: conversion, sync, LoRA --------------------------------------------------------------------
    def rules(self, arch) -> list:
        """The mapping table (checkpoints_convert.mapping.Rule), every block expanded."""
        raise NotImplementedError

    def global_rules(self) -> list:
        raise NotImplementedError

    def block_rules(self, arch, index: int) -> list:
        """Block ``index``'s rules (its global index), names expanded: what a pipeline stage holding that block
        exports.  Blocks may differ (SD3's dual-attention blocks, its last ``context_pre_only`` block)."""
        raise NotImplementedError

    lora_targets: tuple[str, ...] = ()  # the default preset: diffusers module names

    # ---- FLOPs --------------------------------------------------------------------------------------------
    def forward_flops(self, arch, batch: int, image_tokens: int, text_tokens: int) -> float:
        raise NotImplementedError

    def lora_forward_flops(self, arch, rank: int, targets, batch: int, image_tokens: int,
                           text_tokens: int) -> float:
        raise NotImplementedError


def family_names() -> list[str]:
    return sorted(FAMILIES)


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; expected one of {family_names()}")
    return importlib.import_module(FAMILIES[name]).FAMILY


def family_of(arch) -> ModelFamily:
    """The family of an arch config (its class's ``FAMILY``)."""
    name = getattr(type(arch), "FAMILY", None)
    if name is None:
        raise ValueError(f"{type(arch).__name__} names no model family (class attribute FAMILY); expected the arch "
                         f"config of one of {family_names()}")
    return get_family(name)


def family_for_class(class_name: str) -> ModelFamily:
    """The family whose transformer or pipeline diffusers ``_class_name`` is ``class_name``."""
    for name in family_names():
        family = get_family(name)
        if class_name == family.transformer_class or class_name in family.pipeline_classes:
            return family
    known = {n: (get_family(n).transformer_class, *get_family(n).pipeline_classes) for n in family_names()}
    raise ValueError(f"no model family loads diffusers class {class_name!r}; known: {known}")
