"""``megatron-omni train --recipe qwen_image_flow_grpo model.path=DIR`` on a tiny random QwenImagePipeline folder
built offline: the folder's text encoder, VAE, schedule and transformer drive the loop end to end; bad folders and
prompt files are refused with one clear error before anything is written."""
import json

import pytest

from megatron_omni.cli import main
from megatron_omni.testing.tiny_pipelines import build_qwen_image_pipeline

TINY = ["model.dtype=float32", "parallel.device=cpu", "data.height=64", "data.width=64", "data.eval_prompts=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.num_steps=4", "rollout.window_range=[0,1]",
        "lora.rank=4", "lora.alpha=8", "train.micro_batch_size=4", "train.global_batch_size=8",
        "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen_image_pipeline(tmp_path_factory.mktemp("pipe") / "qwen", seed=0)


def _train(folder, out, *extra):
    return main(["train", "--recipe", "qwen_image_flow_grpo", f"model.path={folder}", *TINY,
                 f"train.output_dir={out}", *extra])


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.numerics
def test_ocr_recipe_runs_on_a_pipeline_folder(folder, tmp_path):
    out = tmp_path / "run"
    assert _train(folder, out, "train.steps=3", "train.eval_every=2") == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert ["eval_reward_mean" in r for r in rows] == [False, True, True]  # every 2 steps and at the end
    for r in rows:  # true CFG 4 with the reused uncond outputs: the trainer re-scores the rollout to rounding
        assert r["logprob_abs_diff"] <= 1e-6 and 0.0 <= r["reward_mean"] <= 1.0
    step_dir = out / "checkpoints" / "step_000002"
    assert (step_dir / "run_config.yaml").is_file() and (out / "checkpoints" / "latest").read_text().strip() == "2"
    assert {"samples_step00000.png", "eval_step00001.png", "eval_step00002.png"} <= {p.name for p in out.iterdir()}


def test_pipeline_run_learns_from_a_reward_with_signal(folder, tmp_path):
    """The OCR reward reads nothing in a random tiny model's images (all 0: no advantage); JPEG compressibility
    differs between samples, so the adapters get gradients."""
    out = tmp_path / "jpeg"
    assert _train(folder, out, "train.steps=1", "reward.name=jpeg_compressibility") == 0
    (row,) = _rows(out)
    assert row["grad_norm"] > 0 and row["reward_std"] > 0


def _edit_index(folder, tmp_path, **changes):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, **changes}))
    return copy


@pytest.mark.parametrize("case", ["other class", "missing transformer", "bad jsonl"])
def test_bad_input_is_one_clear_error_and_writes_nothing(folder, tmp_path, capsys, case):
    import shutil

    extra = []
    if case == "other class":
        path, message = _edit_index(folder, tmp_path, _class_name="StableDiffusion3Pipeline"), \
            "holds a 'StableDiffusion3Pipeline'; model.family='qwen_image' loads"
    elif case == "missing transformer":
        path = _edit_index(folder, tmp_path)
        shutil.rmtree(path / "transformer")
        message = "lacks the component 'transformer'"
    else:
        path = folder
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "a sign reading \\"OPEN\\""}\n{"prompt": 3}\n')
        extra, message = [f"data.prompts={prompts}"], "prompts.jsonl:2:"
    out = tmp_path / "out"
    assert _train(path, out, "train.steps=1", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()
