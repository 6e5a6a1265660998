"""SD3 / SD3.5's pipeline parts around the transformer, read from a diffusers ``StableDiffusion3Pipeline`` folder:
the three text encoders, the VAE, the sigma schedule and the initial noise.  Each matches the step of diffusers'
``StableDiffusion3Pipeline`` that it names, numerically, on the same folder.

Text: CLIP-L and CLIP-G give the penultimate hidden states (77 tokens each, concatenated over channels and
zero-padded to T5's width) and their pooled projections (concatenated: ``pooled_BP``, the denoiser's text extra,
model_specs.family); T5 gives 256 tokens after them.  Every one of the 77 + 256 tokens is attended to (the
pipeline passes no mask), so the mask is all True.  Guidance is plain CFG (``cfg_combine`` without rescale).
The transformer's time input is the sigma itself (the pipeline passes ``timestep = 1000 sigma``).

diffusers / transformers are imported inside the functions that need them, so importing this module is cheap.
Shape legend: N prompts; T text tokens (77 + 256); E text width (T5's d_model); P pooled width; I image tokens
(h * w); C packed channels (patch^2 * Z); Z VAE latent channels; H, W pixels; h, w token grid.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from model_specs.sd3.conditioning import pack, unpack

PIPELINE_CLASS = "StableDiffusion3Pipeline"
COMPONENTS = ("scheduler", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
              "tokenizer_3", "transformer", "vae")
POOLED = "pooled_BP"  # SD3Model.forward's keyword for the pooled text
T5_TOKENS = 256  # the pipeline's max_sequence_length default


class SD3TextEncoder:
    """Mirrors ``StableDiffusion3Pipeline.encode_prompt`` (clip_skip None, max_sequence_length 256): per CLIP, the
    prompt padded / truncated to the tokenizer's 77, ``hidden_states[-2]`` and the projected pooled output; T5 on
    the prompt padded / truncated to 256.  Frozen, eval mode; each prompt's result cached by its text."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 t5_tokens: int = T5_TOKENS):
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        folder = Path(folder)
        self.tokenizers = [AutoTokenizer.from_pretrained(folder / n) for n in ("tokenizer", "tokenizer_2",
                                                                               "tokenizer_3")]
        clips = [CLIPTextModelWithProjection.from_pretrained(folder / n, dtype=dtype)
                 for n in ("text_encoder", "text_encoder_2")]
        t5 = T5EncoderModel.from_pretrained(folder / "text_encoder_3", dtype=dtype)
        self.models = [m.to(device).eval().requires_grad_(False) for m in (*clips, t5)]
        self.dtype, self.device, self.t5_tokens = dtype, torch.device(device), t5_tokens
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # prompt -> (emb [T, E], pooled [P])

    def _ids(self, tokenizer, prompts: list[str], length: int) -> torch.Tensor:
        return tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                         return_tensors="pt").input_ids.to(self.device)

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(emb [N, 77 + 256, E], pooled [N, P]) of ``prompts``."""
        hidden, pooled = [], []
        for tokenizer, model in zip(self.tokenizers[:2], self.models[:2]):
            out = model(self._ids(tokenizer, prompts, tokenizer.model_max_length), output_hidden_states=True)
            hidden.append(out.hidden_states[-2].to(self.dtype))  # penultimate layer, before the final norm
            pooled.append(out.text_embeds)
        t5_NTE = self.models[2](self._ids(self.tokenizers[2], prompts, self.t5_tokens))[0].to(self.dtype)
        clip_NTD = torch.cat(hidden, dim=-1)
        clip_NTE = torch.nn.functional.pad(clip_NTD, (0, t5_NTE.shape[-1] - clip_NTD.shape[-1]))
        return torch.cat([clip_NTE, t5_NTE], dim=-2), torch.cat(pooled, dim=-1).to(self.dtype)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(emb [N, T, E], mask [N, T] all True, {"pooled_BP": [N, P]})."""
        if not prompts:
            raise ValueError("no prompts to encode; expected a non-empty list")
        todo = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if todo:
            emb_NTE, pooled_NP = self._encode(todo)
            self._cache.update({p: (emb_NTE[n], pooled_NP[n]) for n, p in enumerate(todo)})
        emb_NTE = torch.stack([self._cache[p][0] for p in prompts])
        mask_NT = torch.ones(emb_NTE.shape[:2], dtype=torch.bool, device=emb_NTE.device)
        return emb_NTE, mask_NT, {POOLED: torch.stack([self._cache[p][1] for p in prompts])}


class SD3VAE:
    """``AutoencoderKL`` of ``vae/`` with the pipeline's latent scaling and shift; images [N, 3, H, W] in [0, 1]."""

    def __init__(self, folder: str | Path, patch: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        from diffusers import AutoencoderKL

        self.model = AutoencoderKL.from_pretrained(Path(folder) / "vae", torch_dtype=dtype)
        self.model = self.model.to(device).eval().requires_grad_(False)
        cfg = self.model.config
        self.z_dim, self.patch = cfg.latent_channels, patch
        self.scale_factor = 2 ** (len(cfg.block_out_channels) - 1)  # the pipeline's vae_scale_factor
        self.scaling, self.shift = cfg.scaling_factor, cfg.shift_factor or 0.0
        self.dtype, self.device = dtype, torch.device(device)

    def latent_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """img_fhw of the token grid of an H x W image: (1, H / (8 patch), W / (8 patch))."""
        step = self.scale_factor * self.patch
        if height % step or width % step or height <= 0 or width <= 0:
            raise ValueError(f"image size {height}x{width}; expected positive multiples of {step} (VAE factor "
                             f"{self.scale_factor} times the transformer's patch {self.patch})")
        return 1, height // step, width // step

    @torch.no_grad()
    def decode(self, tokens_NIC: torch.Tensor, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """Mirrors the end of ``StableDiffusion3Pipeline.__call__`` (output_type="pt"): z / scaling + shift,
        ``vae.decode``, then the image processor's (x / 2 + 0.5) clamped to [0, 1]."""
        _, h, w = img_fhw
        z_NZHW = unpack(tokens_NIC.to(self.device, self.dtype), h, w, self.patch)
        x_N3HW = self.model.decode(z_NZHW / self.scaling + self.shift, return_dict=False)[0]
        return (x_N3HW / 2 + 0.5).clamp(0, 1)


@dataclass
class SD3Scheduler:
    """The sigmas of the folder's ``FlowMatchEulerDiscreteScheduler`` as ``StableDiffusion3Pipeline.__call__``
    drives it: ``set_timesteps(num_steps)`` (static shift; with ``use_dynamic_shifting``, ``mu`` from the image
    token count as the pipeline's ``calculate_shift``).  The scheduler itself computes them."""

    config: dict

    @classmethod
    def from_folder(cls, folder: Path) -> "SD3Scheduler":
        path = folder / "scheduler" / "scheduler_config.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing; expected the FlowMatchEulerDiscreteScheduler config")
        cfg = json.loads(path.read_text())
        if cfg.get("_class_name", "FlowMatchEulerDiscreteScheduler") != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"{path} is for {cfg['_class_name']!r}; expected 'FlowMatchEulerDiscreteScheduler'")
        return cls(cfg)

    def mu(self, image_seq_len: int) -> float:
        c = self.config
        lo, hi = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
        slope = (c.get("max_shift", 1.16) - c.get("base_shift", 0.5)) / (hi - lo)
        return image_seq_len * slope + c.get("base_shift", 0.5) - slope * lo

    def sigmas(self, num_steps: int, image_seq_len: int) -> torch.Tensor:
        """[num_steps + 1] float32 sigmas from the first down to 0; the transformer's time input at step i is
        sigmas[i]."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r}; expected an integer >= 1")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.config)
        extra = {"mu": self.mu(image_seq_len)} if self.config.get("use_dynamic_shifting") else {}
        scheduler.set_timesteps(num_steps, device="cpu", **extra)
        return scheduler.sigmas.to(torch.float32)


def read_model_index(folder: str | Path) -> dict:
    """The model_index.json of an SD3 pipeline folder; ValueError naming what is wrong."""
    folder = Path(folder)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ValueError(f"{index_path} is missing: expected a diffusers pipeline folder (saved with "
                         f"save_pretrained) of {PIPELINE_CLASS!r}")
    index = json.loads(index_path.read_text())
    if index.get("_class_name") != PIPELINE_CLASS:
        raise ValueError(f"{index_path} is a {index.get('_class_name')!r} folder; expected {PIPELINE_CLASS!r}")
    for part in COMPONENTS:
        if not (folder / part).is_dir() or (index.get(part) or [None])[0] is None:
            raise ValueError(f"{folder} lacks the component {part!r} (folder {folder / part}); a {PIPELINE_CLASS} "
                             f"folder needs {list(COMPONENTS)} (T5 included)")
    return index


@dataclass
class SD3Parts:
    """Everything of an SD3 pipeline folder except the transformer, which the caller builds (Megatron) from
    ``transformer_dir``; the pipeline-parts protocol of ``model_specs.family.ModelFamily.pipeline``."""

    text_encoder: SD3TextEncoder
    vae: SD3VAE
    scheduler: SD3Scheduler
    transformer_dir: Path
    pipeline_class: str = PIPELINE_CLASS
    edit: bool = False

    def encode(self, prompts: list[str]):
        """(emb [N, T, E], mask [N, T], {"pooled_BP": [N, P]}) as the pipeline's ``encode_prompt``."""
        return self.text_encoder.encode(prompts)

    def latent_grid(self, height: int, width: int) -> tuple[int, int, int]:
        return self.vae.latent_grid(height, width)

    def decode(self, tokens_NIC: torch.Tensor, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        return self.vae.decode(tokens_NIC, img_fhw)

    def unpack(self, tokens_NIC: torch.Tensor, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """The latent image [N, Z, H / 8, W / 8] of final tokens, in the flow's space (before ``decode``'s
        z / scaling + shift): what a latent reward reads."""
        return unpack(tokens_NIC, img_fhw[1], img_fhw[2], self.vae.patch)

    def sigmas(self, num_steps: int, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        return self.scheduler.sigmas(num_steps, img_fhw[1] * img_fhw[2])

    def noise(self, generator: torch.Generator, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """One sample's initial latents [I, C]: standard normal [1, Z, h * patch, w * patch] drawn from ``generator``
        in the parts' dtype, as ``prepare_latents`` draws a sample (one generator per sample), then packed."""
        _, h, w = img_fhw
        p = self.vae.patch
        z_1ZHW = torch.randn((1, self.vae.z_dim, h * p, w * p), generator=generator, device=generator.device,
                             dtype=self.vae.dtype)
        return pack(z_1ZHW, p)[0]

    @classmethod
    def from_folder(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "SD3Parts":
        folder = Path(path)
        read_model_index(folder)
        patch = json.loads((folder / "transformer" / "config.json").read_text()).get("patch_size", 2)
        return cls(text_encoder=SD3TextEncoder(folder, dtype, device), vae=SD3VAE(folder, patch, dtype, device),
                   scheduler=SD3Scheduler.from_folder(folder), transformer_dir=folder / "transformer")
