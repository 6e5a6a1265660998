"""``megatron-omni train --recipe sd35_flow_grpo model.path=DIR`` on a tiny random StableDiffusion3Pipeline folder
built offline: the folder's three text encoders (the pooled text reaching the denoiser as its text extra), VAE,
schedule and transformer drive the CPS FlowGRPO loop end to end, and the trainer re-scores the rollout's CPS steps
to float32 rounding (logprob_abs_diff <= 1e-6)."""
import json

import pytest

from megatron_omni.cli import main
from megatron_omni.config.recipes import get_recipe
from megatron_omni.testing.tiny_pipelines import build_sd3_pipeline

TINY = ["model.dtype=float32", "parallel.device=cpu", "data.height=64", "data.width=64", "data.eval_prompts=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_range=[0,1]",
        "lora.rank=4", "lora.alpha=8", "train.micro_batch_size=4", "train.global_batch_size=8",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled"]


def test_recipe_is_the_sd35_ocr_shape():
    cfg = get_recipe("sd35_flow_grpo")
    r = cfg.rollout
    assert cfg.model.family == "sd3" and cfg.reward.name == "ocr" and cfg.algorithm.clip_range == 1e-5
    assert (r.sampler, r.noise_level, r.guidance_scale, r.window_size, r.window_range, r.group_size) == \
        ("cps", 0.8, 1.0, 3, (0, 2), 8)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (32, 64, None)  # the family's attention preset


@pytest.mark.numerics
@pytest.mark.parametrize("reward", ["ocr", "jpeg_compressibility"])
def test_sd35_recipe_runs_on_a_pipeline_folder(tmp_path, reward):
    folder = build_sd3_pipeline(tmp_path / "sd3", seed=0)
    out = tmp_path / "run"
    assert main(["train", "--recipe", "sd35_flow_grpo", f"model.path={folder}", *TINY, f"train.output_dir={out}",
                 "train.steps=3", f"reward.name={reward}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        print(f"step {r['step']}: logprob_abs_diff {r['logprob_abs_diff']:.2e}, reward_mean {r['reward_mean']:.3f}, "
              f"grad_norm {r['grad_norm']:.3e}")
        assert r["logprob_abs_diff"] <= 1e-6
    if reward == "ocr":  # reads nothing in a random tiny model's images
        assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    else:  # a reward with signal: the adapters get gradients
        assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in rows)


@pytest.mark.numerics
def test_exported_lora_equals_diffusers_load_lora_weights(tmp_path):
    """A 1-step SD3 run's checkpoint -> `megatron-omni export` (a diffusers LoRA folder) -> `generate --lora` equals
    ``StableDiffusion3Pipeline.load_lora_weights`` at the same seed, and `generate --checkpoint` the same image."""
    import torch
    from diffusers import StableDiffusion3Pipeline

    from megatron_omni.data.prompts import PromptDataset
    from megatron_omni.generate import GenerateOptions, generate
    from tests.qwen_image_reference import rel_err

    folder, run = build_sd3_pipeline(tmp_path / "sd3", seed=0), tmp_path / "run"
    assert main(["train", "--recipe", "sd35_flow_grpo", f"model.path={folder}", *TINY, f"train.output_dir={run}",
                 "train.steps=1", "train.save_every=1", "train.lr=1e-2", "reward.name=jpeg_compressibility"]) == 0
    assert main(["export", "--quiet", "--checkpoint", str(run), "--out", str(tmp_path / "lora")]) == 0
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)

    def reference():
        return pipe("a red cat", height=32, width=48, num_inference_steps=4, guidance_scale=1.0,
                    generator=torch.Generator().manual_seed(7), output_type="pt").images[0]

    base = reference()
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ref = reference()
    options = GenerateOptions(32, 48, 4, 1.0, None, 7, 1, "float32", "cpu")
    prompts = PromptDataset.from_prompts(["a red cat"])
    ours = generate(folder, prompts, tmp_path / "g1", options=options, progress=False, keep_images=True,
                    lora=tmp_path / "lora").images[0]
    policy = generate(folder, prompts, tmp_path / "g2", options=options, progress=False, keep_images=True,
                      checkpoint=run).images[0]
    err, effect = rel_err(ours, ref), rel_err(base, ref)
    print(f"LoRA image vs diffusers {err:.2e} (the adapters' effect {effect:.2e}); checkpoint {rel_err(policy, ours):.2e}")
    assert err <= 1e-4 < 10 * 1e-4 <= effect and rel_err(policy, ours) <= 1e-4


@pytest.mark.numerics
def test_latent_reward_run_decodes_nothing(tmp_path, monkeypatch):
    """The recipe with its reward scored over HTTP on the clean latents (a random-init latent scorer on a local
    server): every rollout and the final evaluation are scored without one VAE decode, and the adapters learn from
    the scores.  The same run with an image judge beside it decodes (the counter sees the VAE's calls)."""
    from diffusers import AutoencoderKL

    from megatron_omni.rewards import build_reward
    from megatron_omni.rewards.latent import LatentRewardServer

    decodes, original = [], AutoencoderKL.decode
    monkeypatch.setattr(AutoencoderKL, "decode", lambda self, *a, **k: decodes.append(1) or original(self, *a, **k))
    folder = build_sd3_pipeline(tmp_path / "sd3", seed=0)
    with LatentRewardServer(build_reward("latent_scorer", channels=16, seed=0)) as server:
        latent_run = ["train", "--recipe", "sd35_flow_grpo", f"model.path={folder}", *TINY, "reward.name=latent_http",
                      f"reward.options.url={server.url}"]
        assert main([*latent_run, f"train.output_dir={tmp_path / 'run'}", "train.steps=2"]) == 0
        assert decodes == []
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1] and "eval_reward_mean" in rows[-1]
        assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 and r["logprob_abs_diff"] <= 1e-6 for r in rows)
        assert not list((tmp_path / "run").glob("*_step*.png"))  # no sample grids: nothing was decoded
        assert main([*latent_run, f"train.output_dir={tmp_path / 'mixed'}", "train.steps=1",
                     "reward.judge=jpeg_compressibility"]) == 0
    assert len(decodes) >= 2  # the rollout's two halves at least (and the evaluation)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("name", ["diffusion_dpo", "diffusion_nft"])
def test_clean_sample_algorithms_carry_the_pooled_text(tmp_path, name):
    """DPO's and NFT's micro-batches carry the family's text extras (SD3's pooled text) into every forward: a step
    of each on the SD3 folder (they refused a family with extras before)."""
    folder = build_sd3_pipeline(tmp_path / "sd3", seed=0)
    out = tmp_path / "run"
    assert main(["train", "--recipe", "sd35_flow_grpo", f"model.path={folder}", *TINY, f"train.output_dir={out}",
                 "train.steps=1", "reward.name=jpeg_compressibility", f"algorithm.name={name}",
                 "algorithm.diffusion_nft.timesteps_per_sample=2"]) == 0
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["grad_norm"] > 0 and row["optimizer_steps"] >= 1
