"""`megatron-omni generate` on a tiny random QwenImagePipeline folder: every image equals diffusers'
``QwenImagePipeline`` at the same seed, size, steps, guidance and negative prompt (float32: decoded images within
1e-4 relative, PNGs within 1/255), with true CFG and without; batching, reruns, LoRA folders written by
`megatron-omni export` from a real training run (equal to diffusers' ``load_lora_weights``) and that run's
checkpoint; data parallel over 2 ranks; bad inputs are one line and write nothing.

Size 32 x 48 (not square, so a swapped height / width shows), 4 steps, true CFG scale 4."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omni import cli
from megatron_omni.data.prompts import PromptDataset
from megatron_omni.generate import MANIFEST, SHEET, GenerateOptions, generate, plan_lines
from megatron_omni.parallel.testing import run_distributed
from megatron_omni.testing.tiny_pipelines import build_qwen_image_pipeline
from tests.qwen_image_reference import rel_err

TOL, PNG_TOL = 1e-4, 1
H, W, STEPS, GUIDANCE, SEED = 32, 48, 4, 4.0, 7
PROMPTS = ["a red cat sitting on a blue mat", "a sign that reads OPEN 24 HOURS", "a photo of a dog in the park"]
TRAIN = ["model.dtype=float32", "parallel.device=cpu", "train.steps=1", "train.save_every=1", "data.height=64",
         "data.width=64", "data.eval_prompts=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.num_steps=4", "rollout.window_range=[0,1]", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2",
         "train.micro_batch_size=4", "train.global_batch_size=4", "algorithm.logprob_check_samples=2",
         "logging.wandb_mode=disabled", "reward.name=jpeg_compressibility"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_qwen_image_pipeline(tmp_path_factory.mktemp("pipe") / "qwen", seed=0)


def _pipe(folder: Path, lora: Path | None = None):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


@pytest.fixture(scope="module")
def pipe(folder):
    return _pipe(folder)


def _reference(pipe, prompt: str, seed: int, negative: str | None, output_type: str = "pt"):
    """diffusers' image: [3, H, W] floats ("pt") or uint8 [H, W, 3] ("pil")."""
    image = pipe(prompt, negative_prompt=negative, true_cfg_scale=GUIDANCE, height=H, width=W,
                 num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                 output_type=output_type).images[0]
    return np.asarray(image) if output_type == "pil" else image


def _options(negative: str | None = "blurry", batch_size: int = 2) -> GenerateOptions:
    return GenerateOptions(H, W, STEPS, GUIDANCE, negative, SEED, batch_size, "float32", "cpu")


def _generate(folder: Path, out: Path, negative: str | None = "blurry", prompts=PROMPTS[:2], **weights):
    return generate(folder, PromptDataset.from_prompts(prompts), out, options=_options(negative), progress=False,
                    keep_images=True, **weights)


def _png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).astype(int)


@pytest.mark.numerics
@pytest.mark.parametrize("negative", ["blurry", None], ids=["true_cfg", "no_negative_prompt"])
def test_images_equal_diffusers(folder, pipe, tmp_path, negative):
    result = _generate(folder, tmp_path / "out", negative)
    for i, prompt in enumerate(PROMPTS[:2]):
        err = rel_err(result.images[i], _reference(pipe, prompt, SEED + i, negative))
        png = np.abs(_png(tmp_path / "out" / f"{i:05d}.png") - _reference(pipe, prompt, SEED + i, negative, "pil"))
        print(f"line {i} ({negative=}): images rel err {err:.2e}, PNG max diff {png.max()}/255")
        assert err <= TOL and png.max() <= PNG_TOL
    if negative is None:  # the rule is the pipeline's: no negative prompt, no CFG, whatever the scale
        cfg = _reference(pipe, PROMPTS[0], SEED, "blurry")
        assert rel_err(result.images[0], cfg) > 10 * TOL


@pytest.mark.numerics
def test_prompt_file_batches_seeds_and_rerun_skips(folder, pipe, tmp_path, capsys):
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    argv = ["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out), "--height", str(H),
            "--width", str(W), "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--negative-prompt", "blurry",
            "--seed", str(SEED), "--batch-size", "2", "--dtype", "float32", "--device", "cpu", "--quiet"]
    assert cli.main(argv) == 0
    entries = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert [(e["index"], e["prompt"], e["seed"], e["file"]) for e in entries] == \
        [(i, p, SEED + i, f"{i:05d}.png") for i, p in enumerate(PROMPTS)]
    assert {(e["negative_prompt"], e["height"], e["width"], e["steps"], e["guidance"]) for e in entries} == \
        {("blurry", H, W, STEPS, GUIDANCE)}
    for i, prompt in enumerate(PROMPTS):
        diff = np.abs(_png(out / f"{i:05d}.png") - _reference(pipe, prompt, SEED + i, "blurry", "pil"))
        assert diff.max() <= PNG_TOL, (i, diff.max())
    assert _png(out / SHEET).shape[1] > 3 * W  # labelled tiles side by side
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "3 skipped" in capsys.readouterr().err
    assert all(p.stat().st_mtime_ns == stamps[p.name] for p in out.glob("0*.png"))  # nothing regenerated
    # an interrupted run leaves only its rank's part: those lines count as finished too
    (out / MANIFEST).rename(out / "manifest.part0.jsonl")
    assert cli.main(argv) == 0
    assert "3 skipped" in capsys.readouterr().err and not (out / "manifest.part0.jsonl").exists()
    assert cli.main([*argv, "--steps", "3"]) == 0  # other settings: every line again
    assert "0 skipped" in capsys.readouterr().err
    assert all(p.stat().st_mtime_ns != stamps[p.name] for p in out.glob("0*.png"))


def test_jsonl_lines_override_seed_and_negative_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "seed": 99, "negative_prompt": ""}\n{"prompt": "c"}\n')
    plan = plan_lines(PromptDataset.from_file(path), _options("blurry"), {})
    assert [(e["seed"], e["negative_prompt"]) for e in plan] == [(SEED, "blurry"), (99, ""), (SEED + 2, "blurry")]


@pytest.fixture(scope="module")
def lora_run(folder, tmp_path_factory) -> tuple[Path, Path]:
    """(run dir, LoRA folder): one real FlowGRPO step on the folder (JPEG compressibility: non-zero advantages,
    so the adapters move), exported by `megatron-omni export`."""
    root = tmp_path_factory.mktemp("lora")
    assert cli.main(["train", "--recipe", "qwen_image_flow_grpo", f"model.path={folder}", *TRAIN,
                     f"train.output_dir={root / 'run'}"]) == 0
    assert cli.main(["export", "--quiet", "--checkpoint", str(root / "run"), "--out", str(root / "lora")]) == 0
    return root / "run", root / "lora"


@pytest.mark.numerics
def test_lora_equals_diffusers_load_lora_weights_and_the_checkpoint(folder, pipe, lora_run, tmp_path):
    run, lora = lora_run
    ours = _generate(folder, tmp_path / "lora", lora=lora)
    policy = _generate(folder, tmp_path / "checkpoint", checkpoint=run)
    pipe_lora = _pipe(folder, lora)
    for i, prompt in enumerate(PROMPTS[:2]):
        reference = _reference(pipe_lora, prompt, SEED + i, "blurry")
        err, vs_checkpoint = rel_err(ours.images[i], reference), rel_err(policy.images[i], ours.images[i])
        effect = rel_err(_reference(pipe, prompt, SEED + i, "blurry"), reference)
        print(f"line {i}: --lora vs load_lora_weights {err:.2e}, vs --checkpoint {vs_checkpoint:.2e}; "
              f"the adapters change the image by {effect:.2e}")
        assert err <= TOL and vs_checkpoint <= TOL and effect > 10 * TOL
    assert json.loads((tmp_path / "lora" / MANIFEST).read_text().splitlines()[0])["lora"] == str(lora.resolve())


def _rank_body(folder: str, out: str) -> list[int]:
    return _generate(Path(folder), Path(out), prompts=PROMPTS).generated


@pytest.mark.numerics
def test_data_parallel_ranks_split_the_lines(folder, pipe, tmp_path):
    out = tmp_path / "dp"
    generated = run_distributed(_rank_body, 2, args=(str(folder), str(out)), timeout_s=300)
    assert generated == [[0, 2], [1]]
    assert [json.loads(line)["index"] for line in (out / MANIFEST).read_text().splitlines()] == [0, 1, 2]
    assert not list(out.glob("manifest.part*")) and (out / SHEET).is_file()
    for i, prompt in enumerate(PROMPTS):
        diff = np.abs(_png(out / f"{i:05d}.png") - _reference(pipe, prompt, SEED + i, "blurry", "pil"))
        assert diff.max() <= PNG_TOL, (i, diff.max())


def _folder_variant(folder: Path, root: Path, case: str) -> Path:
    """A copy of the tiny folder made bad in one way."""
    copy = root / case
    shutil.copytree(folder, copy)
    if case == "other_class":
        index = json.loads((copy / "model_index.json").read_text())
        (copy / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    elif case == "missing_vae":
        shutil.rmtree(copy / "vae")
    elif case == "other_arch":
        config = json.loads((copy / "transformer" / "config.json").read_text())
        (copy / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": 1}))
    return copy


def test_bad_inputs_are_one_line_and_write_nothing(folder, lora_run, tmp_path, capsys):
    run, lora = lora_run
    prompts, bad_jsonl = tmp_path / "p.txt", tmp_path / "bad.jsonl"
    prompts.write_text("a red cat\n")
    bad_jsonl.write_text('{"prompt": "a red cat"}\n{"prompt": 3}\n')
    edit = build_qwen_image_pipeline(tmp_path / "edit", seed=0, edit=True, layers=1)
    variants = {case: _folder_variant(folder, tmp_path, case) for case in ("other_class", "missing_vae", "other_arch")}
    cases = [  # (model, extra arguments, what the message names)
        (folder, ["--lora", str(lora), "--checkpoint", str(run)], "give one of them"),
        (variants["other_class"], [], "no model family loads diffusers class 'FluxPipeline'"),
        (variants["missing_vae"], [], "lacks the component 'vae'"),
        (edit, [], "QwenImageEditPipeline folder: --prompts"),  # an edit takes a JSONL with source images
        (variants["other_arch"], ["--checkpoint", str(run)], "num_layers=2 (model: 1)"),
        (folder, ["--prompts", str(bad_jsonl)], "bad.jsonl:2:"),
        (folder, ["--prompts", str(tmp_path / "nowhere.txt")], "nowhere.txt does not exist"),
        (folder, ["--height", "40"], "image size 40x48"),
        (folder, ["--lora", str(tmp_path)], "pytorch_lora_weights.safetensors is missing"),
    ]
    for model, extra, expected in cases:
        capsys.readouterr()
        argv = ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                "--height", str(H), "--width", str(W), "--steps", "2", "--device", "cpu", "--quiet", *extra]
        assert cli.main(argv) == 1, expected
        err = capsys.readouterr().err
        assert err.startswith("megatron-omni generate: error: ") and len(err.strip().splitlines()) == 1, err
        assert expected in err, err
        assert not (tmp_path / "out").exists()
