"""Qwen-Image's pipeline parts around the transformer, read from a diffusers pipeline folder: the text encoder,
the VAE, the sigma schedule and the initial noise.  Each matches the step of diffusers' ``QwenImagePipeline``
(``QwenImageEditPipeline`` for the edit variant) that it names, numerically, on the same folder.

Guidance is Qwen's "true CFG": ``megatron_omni.rollout.samplers.cfg_combine(v_c, v_u, scale, rescale=
GUIDANCE_RESCALE)``, i.e. the pipeline's ``comb_pred * (‖v_c‖ / ‖comb_pred‖)`` with norms over each token's
channels.  The transformer's time input is the sigma itself (the pipeline passes ``timestep / 1000``).

diffusers / transformers are imported inside the functions that need them, so importing this module is cheap.
Shape legend: N prompts (or images); T text tokens; L tokenised length (template included); E text width;
I packed image tokens (h * w); C packed channels (4 * z); Z VAE latent channels; H, W pixels; h, w token grid.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from model_specs.common.latents import pack_2x2, unpack_2x2

PIPELINE_CLASSES = ("QwenImagePipeline", "QwenImageEditPipeline")
COMPONENTS = {"QwenImagePipeline": ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"),
              "QwenImageEditPipeline": ("processor", "scheduler", "text_encoder", "tokenizer", "transformer", "vae")}
GUIDANCE_RESCALE = "token"  # cfg_combine's rescale that is QwenImagePipeline's true CFG
PACK = 2  # latents are packed 2x2 into tokens


def _text_template(system: str, vision: str = "") -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{vision}{{}}<|im_end|>\n"
            f"<|im_start|>assistant\n")


# the pipelines' prompt_template_encode; the first prompt_template_encode_start_idx hidden states are dropped
T2I_TEMPLATE = _text_template("Describe the image by detailing the color, shape, size, texture, quantity, text, "
                              "spatial relationships of the objects and background:")
EDIT_TEMPLATE = _text_template(
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then explain "
    "how the user's text instruction should alter or modify the image. Generate a new image that meets the user's "
    "requirements while maintaining consistency with the original input where appropriate.",
    "<|vision_start|><|image_pad|><|vision_end|>")
T2I_DROP, EDIT_DROP = 34, 64
IMAGE_TOKEN = "<|image_pad|>"


def pad_embeddings(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt [T_n, E] embeddings -> (emb [N, T, E] zero-padded to the longest, mask [N, T] bool, True = real)."""
    if not rows:
        raise ValueError("no prompts to encode; expected a non-empty list")
    longest = max(r.shape[0] for r in rows)
    emb_NTE = rows[0].new_zeros(len(rows), longest, rows[0].shape[1])
    mask_NT = torch.zeros(len(rows), longest, dtype=torch.bool, device=rows[0].device)
    for n, r in enumerate(rows):
        emb_NTE[n, :r.shape[0]] = r
        mask_NT[n, :r.shape[0]] = True
    return emb_NTE, mask_NT


class QwenImageTextEncoder:
    """Mirrors ``QwenImagePipeline.encode_prompt`` as ``__call__`` uses it: each prompt in the template, tokenised
    (truncated at 1024 + 34 tokens), the Qwen2.5-VL language model's last hidden state (diffusers takes
    ``hidden_states[-1]``, which transformers ties to ``last_hidden_state``, after the final norm), the real
    tokens of each prompt less the first 34, cut at ``max_tokens`` (``max_sequence_length``, 512 in ``__call__``).
    Frozen and in eval mode; the embedding of each prompt is cached by its text."""

    template, drop = T2I_TEMPLATE, T2I_DROP

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_tokens: int | None = 512, tokenizer_dir: str = "tokenizer"):
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        folder = Path(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder / tokenizer_dir)
        full = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder", dtype=dtype)
        self.model = full.model.to(device).eval().requires_grad_(False)  # no LM head: only hidden states are read
        self.dtype, self.device, self.max_tokens = dtype, torch.device(device), max_tokens
        self._cache: dict[object, torch.Tensor] = {}

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(emb [N, T, E] in the encoder's dtype, mask [N, T] bool), padded to the longest prompt."""
        todo = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if todo:
            batch = self.tokenizer([self.template.format(p) for p in todo], max_length=1024 + self.drop,
                                   padding=True, truncation=True, return_tensors="pt").to(self.device)
            hidden_NLE = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            self._cache.update(zip(todo, self._prompt_rows(hidden_NLE, batch.attention_mask)))
        return pad_embeddings([self._cache[p] for p in prompts])

    def _prompt_rows(self, hidden_NLE: torch.Tensor, attention_NL: torch.Tensor) -> list[torch.Tensor]:
        """Each row's real tokens (attention mask 1) less the template's first ``drop``, cut at ``max_tokens``."""
        rows = [h[a.bool()][self.drop:] for h, a in zip(hidden_NLE, attention_NL)]
        return [r[:self.max_tokens].to(self.dtype) if self.max_tokens else r.to(self.dtype) for r in rows]


class QwenImageEditTextEncoder(QwenImageTextEncoder):
    """Mirrors ``QwenImageEditPipeline.encode_prompt``: the edit template with the source image's vision tokens
    (the ``processor/`` folder's image processor and tokenizer, one image per prompt, each ``<|image_pad|>``
    expanded to grid_t * grid_h * grid_w / merge^2 tokens as ``Qwen2VLProcessor`` does), the first 64 hidden
    states dropped, no truncation.  The pipeline hands the processor the source image resized to
    :func:`edit_resolution`; pass images at that size to match it.  Cached by (prompt, image bytes)."""

    template, drop = EDIT_TEMPLATE, EDIT_DROP

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        from transformers import AutoImageProcessor

        super().__init__(folder, dtype, device, max_tokens=None, tokenizer_dir="processor")
        self.image_processor = AutoImageProcessor.from_pretrained(Path(folder) / "processor")

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """``images``: one PIL image per prompt.  Returns (emb [N, T, E], mask [N, T] bool)."""
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} source images for {len(prompts)} prompts; expected one per prompt")
        keys = [(p, _image_digest(im)) for p, im in zip(prompts, images)]
        todo = [i for i, k in enumerate(keys) if k not in self._cache and k not in keys[:i]]
        if todo:
            vision = self.image_processor(images=[images[i] for i in todo], return_tensors="pt")
            merge = self.image_processor.merge_size ** 2
            texts = [self.template.format(prompts[i]).replace(IMAGE_TOKEN, IMAGE_TOKEN * (int(thw.prod()) // merge), 1)
                     for i, thw in zip(todo, vision["image_grid_thw"])]
            batch = self.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
            hidden_NLE = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                    pixel_values=vision["pixel_values"].to(self.device, self.dtype),
                                    image_grid_thw=vision["image_grid_thw"].to(self.device)).last_hidden_state
            self._cache.update(zip([keys[i] for i in todo], self._prompt_rows(hidden_NLE, batch.attention_mask)))
        return pad_embeddings([self._cache[k] for k in keys])


def _image_digest(image) -> tuple:
    return image.size, image.mode, hashlib.sha1(image.tobytes()).hexdigest()


def edit_resolution(width: int, height: int, target_area: int = 1024 * 1024) -> tuple[int, int]:
    """(width, height) that QwenImageEditPipeline resizes a source image to (its ``calculate_dimensions``): the
    image's aspect ratio at about ``target_area`` pixels, each side rounded to a multiple of 32."""
    ratio = width / height
    new_w = math.sqrt(target_area * ratio)
    return round(new_w / 32) * 32, round(new_w / ratio / 32) * 32


class QwenImageVAE:
    """``AutoencoderKLQwenImage`` of ``vae/`` with the pipelines' latent (de)normalisation and 2x2 packing.
    Frozen, eval mode; images are [N, 3, H, W] in [0, 1]."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        from diffusers import AutoencoderKLQwenImage

        self.model = AutoencoderKLQwenImage.from_pretrained(Path(folder) / "vae", torch_dtype=dtype)
        self.model = self.model.to(device).eval().requires_grad_(False)
        cfg = self.model.config
        self.z_dim, self.scale_factor = cfg.z_dim, 2 ** len(cfg.temperal_downsample)  # the pipelines' formula
        self.mean_1Z111 = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(device, dtype)
        self.std_1Z111 = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(device, dtype)
        self.dtype, self.device = dtype, torch.device(device)

    def latent_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """img_fhw of the packed token grid of an H x W image: (1, H / 16, W / 16)."""
        step = self.scale_factor * PACK
        if height % step or width % step or height <= 0 or width <= 0:
            raise ValueError(f"image size {height}x{width}; expected positive multiples of {step} (VAE factor "
                             f"{self.scale_factor} times the {PACK}x{PACK} packing)")
        return 1, height // step, width // step

    @torch.no_grad()
    def decode(self, packed_NIC: torch.Tensor, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """Mirrors the end of ``QwenImagePipeline.__call__`` (output_type="pt"): unpack, z * std + mean (written
        as the pipeline's z / (1 / std) + mean), ``vae.decode`` (which clamps to [-1, 1]), then (x + 1) / 2."""
        _, h, w = img_fhw
        z_NZ1HW = unpack_2x2(packed_NIC.to(self.device, self.dtype), PACK * h, PACK * w)[:, :, None]
        z_NZ1HW = z_NZ1HW / (1.0 / self.std_1Z111) + self.mean_1Z111
        x_N3HW = self.model.decode(z_NZ1HW, return_dict=False)[0][:, :, 0]
        return (x_N3HW * 0.5 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode(self, images_N3HW: torch.Tensor) -> torch.Tensor:
        """Mirrors ``QwenImageEditPipeline._encode_vae_image`` + ``_pack_latents`` on its preprocessed source image
        (2x - 1): the posterior mode ("argmax"), (z - mean) / std, packed 2x2 -> [N, I, C]."""
        x_N31HW = (2.0 * images_N3HW.to(self.device, self.dtype) - 1.0)[:, :, None]
        z_NZ1HW = self.model.encode(x_N31HW).latent_dist.mode()
        z_NZ1HW = (z_NZ1HW - self.mean_1Z111) / self.std_1Z111
        return pack_2x2(z_NZ1HW[:, :, 0])


@dataclass(frozen=True)
class QwenImageScheduler:
    """The sigmas of ``FlowMatchEulerDiscreteScheduler.set_timesteps`` as ``QwenImagePipeline.__call__`` drives it:
    ``sigmas=linspace(1, 1/N, N)`` and ``mu=calculate_shift(image_seq_len, ...)``; then the (dynamic or static)
    shift, the stretch to ``shift_terminal``, and the appended final 0.  Computed in float32 NumPy as the
    scheduler does, so the values are the scheduler's bit for bit.  Defaults are the scheduler's own."""

    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift: float = 1.0
    shift_terminal: float | None = None

    UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                   "stochastic_sampling")

    @classmethod
    def from_config(cls, cfg: dict, source: str = "scheduler_config.json") -> "QwenImageScheduler":
        """From a ``scheduler_config.json`` dict; refuses other schedulers and the options not implemented here."""
        name = cfg.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"{source} is for {name!r}; expected 'FlowMatchEulerDiscreteScheduler'")
        if on := [k for k in cls.UNSUPPORTED if cfg.get(k)]:
            raise ValueError(f"{source} sets {on}; expected them off (not implemented for Qwen-Image)")
        if cfg.get("time_shift_type", "exponential") not in ("exponential", "linear"):
            raise ValueError(f"{source}: time_shift_type={cfg['time_shift_type']!r}; expected 'exponential' "
                             f"or 'linear'")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    def mu(self, image_seq_len: int) -> float:
        """The pipeline's ``calculate_shift``: mu linear in the image token count, base_shift at base_image_seq_len
        and max_shift at max_image_seq_len."""
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return image_seq_len * slope + (self.base_shift - slope * self.base_image_seq_len)

    def sigmas(self, num_steps: int, image_seq_len: int) -> torch.Tensor:
        """[num_steps + 1] float32 sigmas from 1 down to the terminal sigma, then 0; step i goes from sigmas[i]
        to sigmas[i + 1], and the transformer's time input at step i is sigmas[i]."""
        import numpy as np

        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r}; expected an integer >= 1")
        if self.shift_terminal and num_steps == 1:  # its one sigma is 1: the stretch is 0 / 0 (diffusers: NaN)
            raise ValueError(f"num_steps=1 with shift_terminal={self.shift_terminal}; expected num_steps >= 2")
        # float32 arrays with Python-float operands stay float32 (NumPy 2 promotion), as in set_timesteps
        s_N = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
        if self.use_dynamic_shifting:
            mu = self.mu(image_seq_len)
            level = math.exp(mu) if self.time_shift_type == "exponential" else mu
            s_N = level / (level + (1 / s_N - 1))  # e^mu / (e^mu + 1/s - 1), or mu / (mu + 1/s - 1)
        else:
            from megatron_omni.rollout.schedule import shift_sigmas  # the package imports megatron-core

            s_N = shift_sigmas(s_N, self.shift)
        if self.shift_terminal:
            # stretch 1 - s so that the last sigma is shift_terminal (the first stays 1)
            rest_N = 1 - s_N
            s_N = 1 - rest_N / (rest_N[-1] / (1 - self.shift_terminal))
        return torch.cat([torch.from_numpy(s_N.astype(np.float32)), torch.zeros(1)])


def initial_latents(generator: torch.Generator | list[torch.Generator], batch: int, img_fhw: tuple[int, int, int],
                    channels: int, dtype: torch.dtype = torch.float32,
                    device: str | torch.device | None = None) -> torch.Tensor:
    """Mirrors ``QwenImagePipeline.prepare_latents``: standard normal [B, 1, channels, 2h, 2w] (``channels``: the
    VAE's z_dim) drawn in ``dtype`` on the generator's device (one draw of the whole batch from one generator,
    or one [1, ...] draw per generator from a list, as ``randn_tensor``), packed 2x2 -> [B, h * w, 4 * channels]."""
    _, h, w = img_fhw
    frame_shape = (1, channels, PACK * h, PACK * w)
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(f"{len(generator)} generators for a batch of {batch}; expected one per sample")
        z_B1ZHW = torch.cat([torch.randn((1, *frame_shape), generator=g, device=g.device, dtype=dtype)
                             for g in generator])
    else:
        z_B1ZHW = torch.randn((batch, *frame_shape), generator=generator, device=generator.device, dtype=dtype)
    packed_BIC = pack_2x2(z_B1ZHW[:, 0])
    return packed_BIC if device is None else packed_BIC.to(device)


def read_model_index(folder: str | Path) -> tuple[str, dict]:
    """(pipeline class, model_index.json) of a Qwen-Image pipeline folder; ValueError naming what is wrong: no
    folder or index, another pipeline class, a component folder missing."""
    folder = Path(folder)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ValueError(f"{index_path} is missing: expected a diffusers pipeline folder (saved with "
                         f"save_pretrained) of one of {PIPELINE_CLASSES}")
    index = json.loads(index_path.read_text())
    name = index.get("_class_name")
    if name not in PIPELINE_CLASSES:
        raise ValueError(f"{index_path} is a {name!r} folder; expected one of {PIPELINE_CLASSES}")
    for part in COMPONENTS[name]:
        if not (folder / part).is_dir() or index.get(part, [None])[0] is None:
            raise ValueError(f"{folder} lacks the component {part!r} (folder {folder / part}); a {name} folder "
                             f"needs {list(COMPONENTS[name])}")
    return name, index


@dataclass
class QwenImageParts:
    """Everything of a Qwen-Image pipeline folder except the transformer, which the caller builds (Megatron)
    from ``transformer_dir``.  ``edit``: the folder is a ``QwenImageEditPipeline`` (text encoder takes images)."""

    pipeline_class: str
    text_encoder: QwenImageTextEncoder
    vae: QwenImageVAE
    scheduler: QwenImageScheduler
    transformer_dir: Path

    @property
    def edit(self) -> bool:
        return self.pipeline_class == "QwenImageEditPipeline"

    def initial_latents(self, generator: torch.Generator | list[torch.Generator], batch: int,
                        img_fhw: tuple[int, int, int], dtype: torch.dtype = torch.float32,
                        device: str | torch.device | None = None) -> torch.Tensor:
        """:func:`initial_latents` with this folder's VAE latent channels."""
        return initial_latents(generator, batch, img_fhw, self.vae.z_dim, dtype, device)

    # ---- the pipeline-parts protocol generic code uses (model_specs.family.ModelFamily.pipeline) ----------------
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(emb [N, T, E], mask [N, T]) of text-to-image prompts, as the pipeline's ``encode_prompt``."""
        return self.text_encoder.encode(prompts)

    def latent_grid(self, height: int, width: int) -> tuple[int, int, int]:
        return self.vae.latent_grid(height, width)

    def decode(self, packed_NIC: torch.Tensor, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1], as the pipeline's ``output_type="pt"``."""
        return self.vae.decode(packed_NIC, img_fhw)

    def unpack(self, packed_NIC: torch.Tensor, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """The latent image [N, Z, H / 8, W / 8] of final tokens, in the flow's space (before ``decode``'s
        z * std + mean): what a latent reward reads."""
        _, h, w = img_fhw
        return unpack_2x2(packed_NIC, PACK * h, PACK * w)

    def sigmas(self, num_steps: int, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """The pipeline's schedule (dynamic shift from the image token count): [num_steps + 1] float32."""
        return self.scheduler.sigmas(num_steps, img_fhw[0] * img_fhw[1] * img_fhw[2])

    def noise(self, generator: torch.Generator, img_fhw: tuple[int, int, int]) -> torch.Tensor:
        """One sample's initial latents [I, C] drawn as ``prepare_latents`` draws them from ``generator``."""
        return self.initial_latents(generator, 1, img_fhw)[0]

    # ---- edit folders (``edit``): the source image conditions the text and joins the image tokens -------------
    def _require_edit(self, what: str) -> None:
        if not self.edit:
            raise ValueError(f"{what} needs an edit pipeline folder (QwenImageEditPipeline); this one is a "
                             f"{self.pipeline_class}")

    def edit_size(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) of the output for a source image of PIL ``size`` (width, height): the edit pipeline's
        default, :func:`edit_resolution`."""
        self._require_edit("edit_size")
        width, height = edit_resolution(*image_size)
        return height, width

    def edit_inputs(self, image, size: tuple[int, int] | None = None) -> tuple[tuple[int, int, int], torch.Tensor,
                                                                                object]:
        """(img_fhw, context [I, C], resized PIL) of a source image, as ``QwenImageEditPipeline.__call__`` at its
        default size: the image resized (Lanczos, the pipeline's image processor) to :func:`edit_resolution`, which
        is also the output's size (token grid img_fhw); ``context``: its VAE encoding, packed (``prepare_latents``'s
        image_latents), the frame after the sampled one; the resized image is what the text encoder sees.
        ``size`` (height, width): resize to it instead (training at one grid for every source; the pipeline's
        computation whenever its default size for the source is that size)."""
        import numpy as np
        from PIL import Image

        self._require_edit("edit_inputs")
        if size is None:
            width, height = edit_resolution(*image.size)
        else:
            height, width = size
            self.latent_grid(height, width)  # refuses a size the VAE cannot make
        resized = image.convert("RGB").resize((width, height), resample=Image.LANCZOS, reducing_gap=None)
        pixels_13HW = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
        return self.latent_grid(height, width), self.vae.encode(pixels_13HW)[0], resized

    def encode_edit(self, prompts: list[str], images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(emb [N, T, E], mask [N, T]) of edit instructions with their (resized, :meth:`edit_inputs`) source
        images, as the edit pipeline's ``encode_prompt(image=..., prompt=...)``."""
        self._require_edit("encode_edit")
        return self.text_encoder.encode(prompts, images)

    @classmethod
    def from_folder(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "QwenImageParts":
        folder = Path(path)
        name, _ = read_model_index(folder)
        sched_path = folder / "scheduler" / "scheduler_config.json"
        if not sched_path.is_file():
            raise ValueError(f"{sched_path} is missing; expected the FlowMatchEulerDiscreteScheduler config")
        scheduler = QwenImageScheduler.from_config(json.loads(sched_path.read_text()), str(sched_path))
        encoder_cls = QwenImageEditTextEncoder if name == "QwenImageEditPipeline" else QwenImageTextEncoder
        return cls(pipeline_class=name, text_encoder=encoder_cls(folder, dtype, device),
                   vae=QwenImageVAE(folder, dtype, device), scheduler=scheduler,
                   transformer_dir=folder / "transformer")
