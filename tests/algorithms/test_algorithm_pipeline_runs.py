"""A 2-step run of every issue-23 algorithm on a tiny random QwenImagePipeline folder (``megatron-omni train --recipe
qwen_image_flow_grpo model.path=DIR algorithm.name=<name>``): the folder's text encoder, VAE and dynamic-shift
schedule, true CFG 4 in the rollout (the uncond outputs reused by the ratio algorithms), LoRA adapters."""
import json

import pytest

from megatron_omni.cli import main
from megatron_omni.testing.tiny_pipelines import build_qwen_image_pipeline

TINY = ["model.dtype=float32", "parallel.device=cpu", "data.height=64", "data.width=64", "data.eval_prompts=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_range=[0,1]",
        "lora.rank=4", "lora.alpha=8", "train.micro_batch_size=4", "train.global_batch_size=8",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled", "train.steps=2", "train.save_every=0",
        "reward.name=jpeg_compressibility", "algorithm.diffusion_nft.timesteps_per_sample=2"]
NAMES = ["mix_grpo", "grpo_guard", "flow_dppo", "dance_grpo", "diffusion_dpo", "diffusion_nft"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen_image_pipeline(tmp_path_factory.mktemp("pipe") / "qwen", seed=0)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_two_steps_on_a_pipeline_folder(folder, tmp_path, name):
    out = tmp_path / name
    assert main(["train", "--recipe", "qwen_image_flow_grpo", f"model.path={folder}", *TINY,
                 f"algorithm.name={name}", f"train.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["grad_norm"] > 0 and r["optimizer_steps"] >= 1
        if "logprob_abs_diff" in r:  # the ratio algorithms: true CFG re-scored to rounding
            assert r["logprob_abs_diff"] <= 1e-6
    assert ("logprob_abs_diff" in rows[0]) == (name not in ("diffusion_dpo", "diffusion_nft"))


@pytest.mark.numerics
@pytest.mark.slow
def test_srpo_two_steps_on_a_pipeline_folder_with_a_latent_reward(folder, tmp_path):
    """SRPO on the pipeline folder with a differentiable latent reward (``latent_scorer``, random init): x̂0's latent
    image is scored without the VAE, so the reward's gradient reaches the adapters."""
    out = tmp_path / "srpo"
    assert main(["train", "--recipe", "qwen_image_flow_grpo", f"model.path={folder}", *TINY, "algorithm.name=srpo",
                 "reward.name=latent_scorer", "reward.options.channels=16", "reward.judge=null",
                 f"train.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["grad_norm"] > 0 and r["optimizer_steps"] >= 1 and "srpo_reward" in r
    assert rows[0]["srpo_reward"] != rows[1]["srpo_reward"]


def test_srpo_on_a_pipeline_folder_is_refused_without_a_differentiable_reward():
    """SRPO back-propagates the reward through the task's decode: the pipeline recipe's rewards (OCR, JPEG) have no
    gradient, so the run is refused when its config is validated, naming the rewards that have one."""
    from megatron_omni.config import ConfigError, load_config

    for reward in ("ocr", "jpeg_compressibility"):
        with pytest.raises(ConfigError, match=rf"reward.name='{reward}' has no gradient.*'digit_classifier'"):
            load_config("qwen_image_flow_grpo", None, ["algorithm.name=srpo", f"reward.name={reward}"])
