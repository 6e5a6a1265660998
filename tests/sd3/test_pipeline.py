"""SD3's pipeline parts on a tiny random StableDiffusion3Pipeline folder (megatron_omni.testing.tiny_pipelines):
the text encoding (CLIP-L + CLIP-G penultimate states and pooled projections, T5 after them: 77 + 256 tokens),
the schedule, the initial noise and the decode equal diffusers' own steps, and `megatron-omni generate` equals
``StableDiffusion3Pipeline`` at the same seed (float32, images within 1e-4 relative), with plain CFG and without.

Size 32 x 48 (not square), 4 steps, CFG scale 4 with a negative prompt."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_omni.data.prompts import PromptDataset
from megatron_omni.generate import GenerateOptions, generate
from megatron_omni.testing.tiny_pipelines import build_sd3_pipeline
from model_specs.family import family_for_class, split_encoding
from tests.qwen_image_reference import rel_err

TOL = 1e-4
H, W, STEPS, GUIDANCE, SEED = 32, 48, 4, 4.0, 7
PROMPTS = ["a red cat sitting on a blue mat", "a sign that reads OPEN 24 HOURS"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_sd3_pipeline(tmp_path_factory.mktemp("pipe") / "sd3", seed=0)


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def parts(folder):
    family = family_for_class("StableDiffusion3Pipeline")
    assert family.name == "sd3"
    return family.pipeline(folder)


def test_parts_equal_the_pipelines_steps(parts, pipe):
    emb, mask, extras = split_encoding(parts.encode(PROMPTS))
    ref_emb, _, ref_pooled, _ = pipe.encode_prompt(PROMPTS, PROMPTS, PROMPTS, do_classifier_free_guidance=False)
    assert emb.shape == (2, 77 + 256, 64) and bool(mask.all())
    # same modules and inputs; the kernels may differ (no_grad here), so to float32 rounding
    assert rel_err(emb, ref_emb) <= 1e-6 and rel_err(extras["pooled_BP"], ref_pooled) <= 1e-6
    pipe.scheduler.set_timesteps(STEPS)
    assert torch.equal(parts.sigmas(STEPS, parts.latent_grid(H, W)), pipe.scheduler.sigmas.float())
    fhw = parts.latent_grid(H, W)
    assert fhw == (1, H // 16, W // 16)
    ref_noise = pipe.prepare_latents(1, 16, H, W, torch.float32, "cpu", torch.Generator().manual_seed(SEED))
    from model_specs.sd3.conditioning import pack
    assert torch.equal(parts.noise(torch.Generator().manual_seed(SEED), fhw), pack(ref_noise, 2)[0])
    ref_image = pipe.vae.decode(ref_noise / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor)[0]
    ref_image = pipe.image_processor.postprocess(ref_image, output_type="pt")
    assert rel_err(parts.decode(pack(ref_noise, 2), fhw), ref_image) <= 1e-6
    with pytest.raises(ValueError, match="image size 40x48"):
        parts.latent_grid(40, 48)


@pytest.mark.numerics
@pytest.mark.parametrize("negative,guidance", [("blurry", GUIDANCE), (None, GUIDANCE), (None, 1.0)],
                         ids=["cfg", "cfg_no_negative", "no_cfg"])
def test_generate_equals_diffusers(folder, pipe, tmp_path, negative, guidance):
    """``cfg_no_negative``: StableDiffusion3Pipeline runs CFG for any guidance_scale > 1, against "" by default."""
    options = GenerateOptions(H, W, STEPS, guidance, negative, SEED, 2, "float32", "cpu")
    result = generate(folder, PromptDataset.from_prompts(PROMPTS), tmp_path / "out", options=options,
                      progress=False, keep_images=True)
    for i, prompt in enumerate(PROMPTS):
        ref = pipe(prompt, negative_prompt=negative, guidance_scale=guidance, height=H,
                   width=W, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(SEED + i),
                   output_type="pt").images[0]
        err = rel_err(result.images[i], ref)
        print(f"line {i} ({negative=}): images rel err {err:.2e}")
        assert err <= TOL
