"""A task bundles what a run needs besides the denoiser: its prompts (and held-out eval prompts), the text encoder,
the image grid, the sigma schedule, the initial noise and the decoder from final latents to what the rewards read.

``digits`` (the demo): 16x16 pixel-space digits, no VAE — the 2x2-packed "latents" are the pixels.
``pipeline``: a diffusers pipeline folder (``model.path``) through the model family's pipeline parts (its text
encoder with the pipeline's template, VAE, scheduler shift, initial noise as the pipeline draws it) and a prompt
file (``data.prompts``), so that the rollout's ODE sampling is the pipeline's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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
    eval_prompts: list[str] = field(default_factory=list)  # held out of training (train.eval_every)
    sigmas: Callable[[int], torch.Tensor] | None = None  # num_steps -> its schedule; None: the static shift's
    noise: Callable | None = None  # (generator, img_fhw) -> initial latents [S_I, C]; None: randn
    # decoded images -> float [N, C, H, W] in [0, 1] for sample grids; None: the decoded images are [N, H, W] gray
    preview: Callable[[torch.Tensor], torch.Tensor] | None = None


def build_task(name: str, text_max_tokens: int = 16) -> Task:
    if name != "digits":
        raise ValueError(f"unknown task {name!r}; expected 'digits'")
    from megatron_omni.data.text_encoder import MiniLMEncoder

    encoder = MiniLMEncoder(max_tokens=text_max_tokens)
    return Task(name="digits", prompts=[digits.prompt_for(d) for d in range(10)], img_fhw=digits.GRID_FHW,
                encode=encoder.encode, decode=lambda x: digits.to_unit_images(digits.unpack_2x2(x)),
                text_dim=MiniLMEncoder.hidden_size, latent_channels=digits.CHANNELS)


def task_for(cfg, device="cpu") -> Task:
    """The task of a run config: ``data.task``."""
    if cfg.data.task == "digits":
        return build_task("digits", cfg.data.text_max_tokens)
    return pipeline_task(cfg, device)


def pipeline_task(cfg, device="cpu") -> Task:
    """The ``model.path`` pipeline folder's parts (its model family's) and the ``data.prompts`` prompts, with
    ``data.eval_prompts`` of them held out (a fixed split by ``train.seed``); images decode to uint8 [N, H, W, 3],
    what the image rewards read."""
    from megatron_omni.data.prompts import PromptDataset, load_ocr_prompts, split

    family, d = cfg.model.family_impl, cfg.data
    if cfg.model.path is None:
        raise ValueError(f"data.task: 'pipeline' needs model.path=DIR, a diffusers pipeline folder (model_index.json) "
                         f"of {list(family.pipeline_classes)}")
    parts = family.pipeline(cfg.model.path, cfg.model.torch_dtype, device)
    dataset = PromptDataset.from_file(d.prompts) if d.prompts else load_ocr_prompts()
    train, held_out = split(dataset, eval_count=d.eval_prompts, seed=cfg.train.seed)
    img_fhw = parts.latent_grid(d.height, d.width)

    def decode(latents_NIC: torch.Tensor) -> torch.Tensor:
        images_N3HW = parts.decode(latents_NIC, img_fhw).float().cpu()
        return (images_N3HW * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    return Task(name=f"pipeline:{cfg.model.path}", prompts=train.prompts, img_fhw=img_fhw, encode=parts.encode,
                decode=decode, text_dim=family.text_dim(cfg.model.arch),
                latent_channels=family.latent_channels(cfg.model.arch), eval_prompts=held_out.prompts,
                sigmas=lambda n: parts.sigmas(n, img_fhw), noise=parts.noise,
                preview=lambda images: images.permute(0, 3, 1, 2).float() / 255)
