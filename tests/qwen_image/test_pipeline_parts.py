"""Qwen-Image pipeline parts (model_specs.qwen_image.pipeline) against diffusers' own pipelines on the SAME tiny
random-init folders (megatron_omni.testing.tiny_pipelines), float32 on the CPU: text embeddings, sigmas, initial
noise, VAE decode/encode, and a whole true-CFG Euler sampling run with the Megatron transformer."""
import json
import shutil

import numpy as np
import pytest
import torch

from megatron_omni.rollout.samplers import cfg_combine, ode_mean_std
from megatron_omni.testing.tiny_pipelines import build_qwen_image_pipeline, edit_pipeline_processor
from model_specs.qwen_image.pipeline import (
    EDIT_DROP, EDIT_TEMPLATE, GUIDANCE_RESCALE, T2I_DROP, T2I_TEMPLATE, QwenImageEditTextEncoder, QwenImageParts,
    QwenImageScheduler, QwenImageVAE, initial_latents,
)
from tests.qwen_image_reference import rel_err

pytestmark = pytest.mark.numerics

PROMPTS = ["a red cat sitting on a blue mat", "a sign that reads OPEN 24 HOURS", " "]
EMB_TOL, VAE_TOL, E2E_TOL = 1e-5, 1e-5, 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_image_pipelines")
    return {"t2i": build_qwen_image_pipeline(root / "t2i", seed=0),
            "edit": build_qwen_image_pipeline(root / "edit", seed=1, edit=True)}


@pytest.fixture(scope="module")
def pipe(folders):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(folders["t2i"])


@pytest.fixture(scope="module")
def parts(folders):
    return QwenImageParts.from_folder(folders["t2i"], torch.float32, "cpu")


@pytest.fixture(scope="module")
def edit_pipe(folders):
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline.from_pretrained(folders["edit"], processor=edit_pipeline_processor(folders["edit"]))


def _source_images(n, size=64):
    from PIL import Image

    g = np.random.default_rng(3)
    return [Image.fromarray(g.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _as_tensor(images):
    return torch.stack([torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1) for im in images])


def test_folders_are_a_function_of_the_seed(folders, tmp_path):
    again = build_qwen_image_pipeline(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(folders["t2i"]) for p in folders["t2i"].rglob("*") if p.is_file())
    assert all((again / f).read_bytes() == (folders["t2i"] / f).read_bytes() for f in files)
    other = build_qwen_image_pipeline(tmp_path / "other", seed=5)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (other / weights).read_bytes() != (again / weights).read_bytes()


def test_templates_are_the_pipelines(pipe, edit_pipe):
    assert (T2I_TEMPLATE, T2I_DROP) == (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx)
    assert (EDIT_TEMPLATE, EDIT_DROP) == (edit_pipe.prompt_template_encode, edit_pipe.prompt_template_encode_start_idx)
    # the tiny tokenizer splits each template's prefix into exactly the tokens the pipelines drop, as Qwen2.5-VL's
    prefix = pipe.tokenizer(T2I_TEMPLATE.split("{}")[0]).input_ids
    edit_prefix = pipe.tokenizer(EDIT_TEMPLATE.split("<|vision_start|>")[0]).input_ids
    assert (len(prefix), len(edit_prefix)) == (T2I_DROP, EDIT_DROP)


def test_text_embeddings_match_encode_prompt(pipe, parts):
    emb_ref, mask_ref = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    emb, mask = parts.text_encoder.encode(PROMPTS)
    assert emb.shape == emb_ref.shape and emb.dtype == torch.float32
    assert torch.equal(mask, mask_ref.bool())
    assert rel_err(emb, emb_ref) <= EMB_TOL
    for prompt in PROMPTS:  # one prompt at a time, as __call__ encodes it (its mask is then None: no padding)
        one_ref, one_mask = pipe.encode_prompt(prompt, device="cpu", max_sequence_length=512)
        one, one_ours = parts.text_encoder.encode([prompt])
        assert one_mask is None and bool(one_ours.all()) and rel_err(one, one_ref) <= EMB_TOL
    again, _ = parts.text_encoder.encode(PROMPTS[::-1])  # served from the per-prompt cache
    assert torch.equal(again[-1, :int(mask[0].sum())], emb[0, :int(mask[0].sum())])


def _scheduler_sigmas(scheduler, num_steps, image_seq_len):
    """What QwenImagePipeline.__call__ makes its scheduler do (its steps 5: sigmas, mu, retrieve_timesteps)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    c = scheduler.config
    mu = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu",
                                      sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas, timesteps


@pytest.mark.parametrize("num_steps,image_seq_len", [(4, 16), (2, 16), (10, 1024), (28, 4096), (50, 9000)])
def test_sigmas_match_the_pipeline_scheduler(pipe, parts, num_steps, image_seq_len):
    expected, timesteps = _scheduler_sigmas(pipe.scheduler, num_steps, image_seq_len)
    sigmas = parts.scheduler.sigmas(num_steps, image_seq_len)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    assert torch.equal(sigmas, expected), (sigmas - expected).abs().max()
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and sigmas[-2] == pytest.approx(0.02, abs=1e-6)
    # the transformer's time input in the pipeline is timestep / 1000: the sigma up to float32 rounding
    assert torch.allclose(timesteps / 1000, sigmas[:-1], rtol=2.5e-7, atol=0)  # 2 ulp


def test_one_step_with_a_terminal_sigma_is_refused(pipe, parts):
    with np.errstate(invalid="ignore"):
        expected, _ = _scheduler_sigmas(pipe.scheduler, 1, 16)
    assert torch.isnan(expected[0])  # diffusers stretches 1 - sigma by 0 / 0
    with pytest.raises(ValueError, match="num_steps=1 with shift_terminal"):
        parts.scheduler.sigmas(1, 16)


def test_static_shift_and_refused_options():
    from diffusers import FlowMatchEulerDiscreteScheduler

    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    expected, _ = _scheduler_sigmas(ref, 8, 64)
    assert torch.equal(QwenImageScheduler.from_config(dict(ref.config)).sigmas(8, 64), expected)
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        QwenImageScheduler.from_config({"use_karras_sigmas": True})
    with pytest.raises(ValueError, match="DDIMScheduler"):
        QwenImageScheduler.from_config({"_class_name": "DDIMScheduler"})


def test_initial_latents_match_prepare_latents(pipe, parts):
    img_fhw = parts.vae.latent_grid(64, 96)
    ref = pipe.prepare_latents(3, 16, 64, 96, torch.float32, "cpu", torch.Generator().manual_seed(7))
    ours = initial_latents(torch.Generator().manual_seed(7), 3, img_fhw, parts.vae.z_dim, torch.float32)
    assert img_fhw == (1, 4, 6) and torch.equal(ours, ref)
    gens = lambda: [torch.Generator().manual_seed(11 + i) for i in range(3)]  # noqa: E731 (one per prompt)
    ref = pipe.prepare_latents(3, 16, 64, 96, torch.float32, "cpu", gens())
    assert torch.equal(initial_latents(gens(), 3, img_fhw, parts.vae.z_dim), ref)
    assert torch.equal(ref[1:2], pipe.prepare_latents(1, 16, 64, 96, torch.float32, "cpu", gens()[1]))


def test_vae_decode_matches_the_pipeline(pipe, parts):
    latents_BIC = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    z = pipe._unpack_latents(latents_BIC, 64, 64, pipe.vae_scale_factor)
    c = pipe.vae.config
    z = z / (1.0 / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)) + torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        ref = pipe.image_processor.postprocess(pipe.vae.decode(z, return_dict=False)[0][:, :, 0], output_type="pt")
    images = parts.vae.decode(latents_BIC, parts.vae.latent_grid(64, 64))
    assert images.shape == (2, 3, 64, 64) and 0 <= images.min() and images.max() <= 1
    assert rel_err(images, ref) <= VAE_TOL


def _megatron_transformer(folder, tp_group):
    from checkpoints_convert.convert import mcore_state_from_hf
    from checkpoints_convert.hf_folder import HFFolder
    from model_specs.qwen_image.config import QwenImageConfig
    from model_specs.qwen_image.model import QwenImageModel
    from model_specs.qwen_image.spec import qwen_image_block_spec

    hf = HFFolder(folder)
    arch = QwenImageConfig.from_diffusers(hf.config)
    model = QwenImageModel(arch, arch.transformer_config(1, perform_initialization=False), tp_group,
                           qwen_image_block_spec("local"))
    result = model.load_state_dict(mcore_state_from_hf(arch, hf.get), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model.eval()


def test_true_cfg_euler_sampling_matches_the_pipeline(pipe, parts, single_rank):
    """prompt + negative prompt, true CFG 4, 4 Euler steps, 64x64, seed 7: our parts + the Megatron transformer
    + cfg_combine + the rollout's Euler step give the pipeline's decoded image."""
    prompt, negative, scale, steps = "a sign that reads OPEN 24 HOURS", " ", 4.0, 4
    model = _megatron_transformer(parts.transformer_dir, single_rank.tp_group)
    img_fhw = parts.vae.latent_grid(64, 64)
    (emb_c, mask_c), (emb_u, mask_u) = parts.text_encoder.encode([prompt]), parts.text_encoder.encode([negative])
    x_BIC = initial_latents(torch.Generator().manual_seed(7), 1, img_fhw, parts.vae.z_dim)
    sigmas = parts.scheduler.sigmas(steps, img_fhw[1] * img_fhw[2])
    with torch.no_grad():
        for i in range(steps):
            sigma_B = sigmas[i].expand(1)
            v_c, v_u = model(x_BIC, emb_c, sigma_B, img_fhw, mask_c), model(x_BIC, emb_u, sigma_B, img_fhw, mask_u)
            x_BIC, _ = ode_mean_std(x_BIC, cfg_combine(v_c, v_u, scale, rescale=GUIDANCE_RESCALE), sigmas[i],
                                   sigmas[i + 1])
    images = parts.vae.decode(x_BIC, img_fhw)
    ref = pipe(prompt, negative_prompt=negative, true_cfg_scale=scale, num_inference_steps=steps, height=64,
               width=64, generator=torch.Generator().manual_seed(7), output_type="pt").images
    assert images.shape == ref.shape == (1, 3, 64, 64)
    err = rel_err(images, ref)
    print(f"end-to-end image rel err {err:.2e}")
    assert err <= E2E_TOL


def test_cfg_combine_is_the_pipelines_true_cfg():
    g = torch.Generator().manual_seed(4)
    v_c, v_u = torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    comb = v_u + 4.0 * (v_c - v_u)
    expected = comb * (torch.norm(v_c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    assert torch.equal(cfg_combine(v_c, v_u, 4.0, rescale=GUIDANCE_RESCALE), expected)


def test_edit_text_encoding_matches_the_edit_pipeline(folders, edit_pipe):
    encoder = QwenImageEditTextEncoder(folders["edit"], torch.float32, "cpu")
    images = _source_images(2)
    prompts = ["make the sky green", "add the word HELLO"]
    emb_ref, mask_ref = edit_pipe.encode_prompt(prompts, image=images, device="cpu")
    emb, mask = encoder.encode(prompts, images)
    assert emb.shape == emb_ref.shape and torch.equal(mask, mask_ref.bool())
    assert rel_err(emb, emb_ref) <= EMB_TOL
    one_ref, _ = edit_pipe.encode_prompt(prompts[1], image=images[1], device="cpu")
    assert rel_err(encoder.encode([prompts[1]], [images[1]])[0], one_ref) <= EMB_TOL
    with pytest.raises(ValueError, match="one per prompt"):
        encoder.encode(prompts, images[:1])


def test_edit_vae_encode_matches_the_edit_pipeline(folders, edit_pipe):
    vae = QwenImageVAE(folders["edit"], torch.float32, "cpu")
    images = _source_images(2)
    pixels = torch.cat([edit_pipe.image_processor.preprocess(im, 64, 64) for im in images])  # [-1, 1]
    with torch.no_grad():
        ref = edit_pipe._encode_vae_image(pixels.unsqueeze(2), generator=None)
    ref = edit_pipe._pack_latents(ref, 2, vae.z_dim, *ref.shape[3:])
    ours = vae.encode(_as_tensor(images))
    assert ours.shape == (2, 16, 64) and rel_err(ours, ref) <= VAE_TOL


def test_folder_of_another_pipeline_is_refused(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline"):
        QwenImageParts.from_folder(tmp_path)
    with pytest.raises(ValueError, match="model_index.json is missing"):
        QwenImageParts.from_folder(tmp_path / "nowhere")


def test_missing_component_is_named(folders, tmp_path):
    broken = shutil.copytree(folders["t2i"], tmp_path / "broken")
    shutil.rmtree(broken / "vae")
    with pytest.raises(ValueError, match="component 'vae'"):
        QwenImageParts.from_folder(broken)


def test_latent_grid_refuses_sizes_the_packing_cannot_take(parts):
    with pytest.raises(ValueError, match="multiples of 16"):
        parts.vae.latent_grid(70, 64)
