"""A task bundles what a run needs besides the denoiser: its prompts (and held-out eval prompts), the text encoder,
the image grid, the sigma schedule, the initial noise, the decoder from final latents to what the image rewards read,
and the unpacking of final latents to the latent images that latent rewards read (megatron_omni.rewards.latent).

``digits`` (the demo): 16x16 pixel-space digits, no VAE — the 2x2-packed "latents" are the pixels.
``pipeline``: a diffusers pipeline folder (``model.path``) through the model family's pipeline parts (its text
encoder with the pipeline's template, VAE, scheduler shift, initial noise as the pipeline draws it) and a prompt
file (``data.prompts``), so that the rollout's ODE sampling is the pipeline's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_omni.data import digits


@dataclass
class Task:
    name: str
    prompts: list[str]
    img_fhw: tuple[int, int, int]
    encode: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]  # prompts -> (emb [N,T,E], mask [N,T])
    decode: Callable[[torch.Tensor], torch.Tensor]  # final latents [N, S_I, C] -> images [N, H, W] in [0, 1]
    text_dim: int
    latent_channels: int
    # final latents [N, S_I, C] -> float32 latent images [N, Z, H, W] in the flow's space (no VAE), for latent rewards
    latents: Callable[[torch.Tensor], torch.Tensor] | None = None
    eval_prompts: list[str] = field(default_factory=list)  # held out of training (train.eval_every)
    sigmas: Callable[[int], torch.Tensor] | None = None  # num_steps -> its schedule; None: the static shift's
    noise: Callable | None = None  # (generator, img_fhw) -> initial latents [S_I, C]; None: randn
    # decoded images -> float [N, C, H, W] in [0, 1] for sample grids; None: the decoded images are [N, H, W] gray
    preview: Callable[[torch.Tensor], torch.Tensor] | None = None
    # the records behind ``prompts`` / ``eval_prompts`` (an edit's carry their source images); None: the prompts
    records: Any = None  # megatron_omni.data.prompts.PromptDataset
    eval_records: Any = None
    # (record, negative prompt, true CFG) -> Request fields of its own: an edit's context_latents and its
    # prompt / negative-prompt embeddings encoded with its source image; None: none (the engine encodes the text)
    request_inputs: Callable[[Any, str, bool], dict] | None = None
    # its text encoder and VAE moved to host memory while the policy trains (data.offload_encoders); None: kept
    offload: Any = None  # megatron_omni.trainer.offload.PartsOffload

    def park(self) -> None:
        """The text encoder and VAE to host memory until the next encode / decode needs them (``offload``)."""
        if self.offload is not None:
            self.offload.offload()

    def dataset(self, held_out: bool = False):
        """The training (``held_out``: eval) records as a PromptDataset, in the order of ``prompts``."""
        from megatron_omni.data.prompts import PromptDataset

        records = self.eval_records if held_out else self.records
        if records is not None:
            return records
        prompts = self.eval_prompts if held_out else self.prompts
        return PromptDataset.from_prompts(prompts) if prompts else None

    def inputs_for(self, record, negative_prompt: str, cfg: bool) -> dict:
        """The Request fields ``record`` brings (``request_inputs``), {} for a text-only task."""
        return {} if self.request_inputs is None else self.request_inputs(record, negative_prompt, cfg)


def build_task(name: str, text_max_tokens: int = 16) -> Task:
    if name != "digits":
        raise ValueError(f"unknown task {name!r}; expected 'digits'")
    from megatron_omni.data.text_encoder import MiniLMEncoder

    encoder = MiniLMEncoder(max_tokens=text_max_tokens)
    return Task(name="digits", prompts=[digits.prompt_for(d) for d in range(10)], img_fhw=digits.GRID_FHW,
                encode=encoder.encode, decode=lambda x: digits.to_unit_images(digits.unpack_2x2(x)),
                text_dim=MiniLMEncoder.hidden_size, latent_channels=digits.CHANNELS,
                latents=lambda x: digits.unpack_2x2(x).float())  # the pixels are the latents: [N, 1, 16, 16]


def task_for(cfg, device="cpu") -> Task:
    """The task of a run config: ``data.task``."""
    if cfg.data.task == "digits":
        return build_task("digits", cfg.data.text_max_tokens)
    return pipeline_task(cfg, device)


def pipeline_task(cfg, device="cpu") -> Task:
    """The ``model.path`` pipeline folder's parts (its model family's) and the ``data.prompts`` prompts, with
    ``data.eval_prompts`` of them held out (a fixed split by ``train.seed``); images decode to uint8 [N, H, W, 3],
    what the image rewards read."""
    from megatron_omni.data.prompts import EditDataset, PromptDataset, load_ocr_prompts, split
    from megatron_omni.trainer.offload import PartsOffload

    family, d = cfg.model.family_impl, cfg.data
    if cfg.model.path is None:
        raise ValueError(f"data.task: 'pipeline' needs model.path=DIR, a diffusers pipeline folder (model_index.json) "
                         f"of {list(family.pipeline_classes)}")
    parts = family.pipeline(cfg.model.path, cfg.model.torch_dtype, device)
    img_fhw = parts.latent_grid(d.height, d.width)
    if parts.edit and not d.prompts:
        raise ValueError(f"{cfg.model.path} is an edit pipeline folder ({parts.pipeline_class}): it trains on edit "
                         f"instructions with source images; expected data.prompts=FILE.jsonl with a "
                         f'{{"prompt": ..., "image": ...}} per line')
    if parts.edit:
        dataset = EditDataset.from_file(d.prompts)
    else:
        dataset = PromptDataset.from_file(d.prompts) if d.prompts else load_ocr_prompts()
    train, held_out = split(dataset, eval_count=d.eval_prompts, seed=cfg.train.seed)

    offload = PartsOffload([parts.text_encoder, parts.vae], device) if d.offload_encoders else None
    onloaded = offload.wrap if offload is not None else (lambda fn: fn)

    @onloaded
    def decode(latents_NIC: torch.Tensor) -> torch.Tensor:
        images_N3HW = parts.decode(latents_NIC, img_fhw).float().cpu()
        return (images_N3HW * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    edit_inputs = onloaded(EditInputs(parts, (d.height, d.width))) if parts.edit else None
    return Task(name=f"pipeline:{cfg.model.path}", prompts=train.prompts, img_fhw=img_fhw,
                encode=onloaded(parts.encode),
                decode=decode, text_dim=family.text_dim(cfg.model.arch),
                latent_channels=family.latent_channels(cfg.model.arch), eval_prompts=held_out.prompts,
                latents=lambda latents_NIC: parts.unpack(latents_NIC.float(), img_fhw),
                sigmas=lambda n: parts.sigmas(n, img_fhw), noise=parts.noise,
                preview=lambda images: images.permute(0, 3, 1, 2).float() / 255, records=train,
                eval_records=held_out, request_inputs=edit_inputs, offload=offload)


class EditInputs:
    """An edit record's Request fields at the run's image size: its source image resized to (height, width) and
    VAE-encoded as ``context_latents`` (``parts.edit_inputs``), the instruction and, with true CFG, the negative
    prompt encoded with that resized image (``parts.encode_edit``).  Kept for the ``capacity`` records used last
    (a record is drawn again and again: once per group member, and at later steps)."""

    def __init__(self, parts, size: tuple[int, int], capacity: int = 256):
        self.parts, self.size, self.capacity = parts, size, capacity
        self._cache: dict = {}  # key -> fields, oldest first

    def __call__(self, record, negative_prompt: str, cfg: bool) -> dict:
        key = (record.split_key(), negative_prompt, cfg)
        fields = self._cache.pop(key, None)
        if fields is None:
            _, context, resized = self.parts.edit_inputs(record.load_image(), self.size)
            texts = [record.prompt] + ([negative_prompt] if cfg else [])
            emb, mask = self.parts.encode_edit(texts, [resized] * len(texts))
            fields = dict(context_latents=context, prompt_emb=emb[0], prompt_mask=mask[0])
            if cfg:
                fields.update(negative_prompt_emb=emb[1], negative_prompt_mask=mask[1])
            if len(self._cache) >= self.capacity:
                self._cache.pop(next(iter(self._cache)))
        self._cache[key] = fields  # (re)inserted last: the most recently used
        return fields
