"""``megatron-omni train --recipe qwen_image_edit_flow_grpo`` on a tiny random QwenImageEditPipeline folder and a
JSONL of edits: every request carries its source image (resized to the run's size, VAE-encoded as context tokens)
and its instruction encoded with that image; three steps end with metrics, eval rows and a checkpoint, the trainer
re-scoring the rollout to rounding; an edit folder without an edit file is one clear error."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omni.cli import main
from megatron_omni.testing.tiny_pipelines import build_qwen_image_pipeline

SIZE = 64  # pixels: a 4 x 4 token grid, and as many context tokens
TINY = ["model.dtype=float32", "parallel.device=cpu", f"data.height={SIZE}", f"data.width={SIZE}",
        "data.eval_prompts=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.num_steps=4",
        "rollout.window_range=[0,1]", "lora.rank=4", "lora.alpha=8", "train.micro_batch_size=2",
        "train.global_batch_size=8", "algorithm.logprob_check_samples=4", "logging.wandb_mode=disabled"]
EDITS = [('Write "OPEN" on the sign', (64, 64)), ('Change the text to "SALE"', (80, 48)),
         ('Add the word "HELLO"', (48, 64)), ('Replace the title with "NEWS"', (64, 64)),
         ('Paint "STOP" in red', (32, 32))]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_qwen_image_pipeline(tmp_path_factory.mktemp("pipe") / "edit", seed=0, edit=True, layers=1)


@pytest.fixture(scope="module")
def edits(tmp_path_factory) -> Path:
    """Sources of several sizes and aspect ratios (all resized to the run's SIZE x SIZE)."""
    root = tmp_path_factory.mktemp("edits")
    g = np.random.default_rng(3)
    lines = []
    for i, (prompt, (w, h)) in enumerate(EDITS):
        Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"src{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"src{i}.png"}) + "\n")
    (root / "edits.jsonl").write_text("".join(lines))
    return root / "edits.jsonl"


def _cfg(folder, edits, out, *extra):
    from megatron_omni.config import load_config

    return load_config("qwen_image_edit_flow_grpo", None, [f"model.path={folder}", f"data.prompts={edits}", *TINY,
                                                           f"train.output_dir={out}", *extra])


def test_edit_requests_carry_the_source_and_its_text(folder, edits, tmp_path):
    """FlowGRPO's requests of a step: context tokens = the source resized to the run's size and VAE-encoded, the
    instruction and the negative prompt encoded with that resized image (the edit pipeline's encode_prompt)."""
    from megatron_omni.algorithms.flow_grpo import ALGORITHM
    from megatron_omni.data.tasks import task_for
    from model_specs.family import get_family

    cfg = _cfg(folder, edits, tmp_path / "run")
    task = task_for(cfg)
    run = SimpleNamespace(cfg=cfg, task=task, family=get_family("qwen_image"))
    requests = ALGORITHM.requests(run, step=0)
    assert len(requests) == 2 * 2 and task.img_fhw == (1, SIZE // 16, SIZE // 16)
    parts = get_family("qwen_image").pipeline(folder, torch.float32, "cpu")
    by_prompt = {r.prompt: r for r in task.dataset()}
    for q in requests:
        record = by_prompt[q.prompt]
        fhw, context, resized = parts.edit_inputs(record.load_image(), (SIZE, SIZE))
        assert fhw == task.img_fhw and resized.size == (SIZE, SIZE)
        assert q.context_latents.shape == (16, 64) and torch.equal(q.context_latents, context)
        emb, mask = parts.encode_edit([q.prompt, ""], [resized, resized])
        real = int(mask[0].sum())
        torch.testing.assert_close(q.prompt_emb[q.prompt_mask][:real], emb[0][:real], rtol=0, atol=0)
        torch.testing.assert_close(q.negative_prompt_emb[q.negative_prompt_mask],
                                   emb[1][:int(mask[1].sum())], rtol=0, atol=0)
    # the source image changes the instruction's embedding (the text encoder sees it)
    other = parts.encode_edit([requests[0].prompt], [Image.new("RGB", (SIZE, SIZE))])[0][0]
    assert not torch.allclose(other[:real], requests[0].prompt_emb[:real])
    # the held-out edits are requested for eval with their sources too
    from megatron_omni.trainer.evaluate import eval_requests

    held = eval_requests(run)
    assert len(held) == 2 and all(q.context_latents is not None and q.sampler == "ode" for q in held)
    assert not {q.prompt for q in held} & {r.prompt for r in task.dataset()}


def _train(folder, edits, out, *extra) -> list[dict]:
    assert main(["train", "--recipe", "qwen_image_edit_flow_grpo", f"model.path={folder}", f"data.prompts={edits}",
                 *TINY, f"train.output_dir={out}", *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.numerics
def test_edit_recipe_trains_three_steps_with_the_ocr_reward(folder, edits, tmp_path):
    out = tmp_path / "run"
    rows = _train(folder, edits, out, "train.steps=3", "train.eval_every=2")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert ["eval_reward_mean" in r for r in rows] == [False, True, True]
    for r in rows:  # true CFG 4, reused uncond outputs, context tokens: the trainer re-scores the rollout
        assert r["logprob_abs_diff"] <= 1e-6 and 0.0 <= r["reward_mean"] <= 1.0
    assert (out / "checkpoints" / "latest").read_text().strip() == "2"
    assert {"samples_step00000.png", "eval_step00001.png", "eval_step00002.png"} <= {p.name for p in out.iterdir()}


def test_edit_run_learns_from_a_reward_with_signal(folder, edits, tmp_path):
    """OCR reads nothing in a random tiny model's edits (no advantage); JPEG compressibility differs between
    samples, so the adapters get gradients through the context-token forward."""
    (row,) = _train(folder, edits, tmp_path / "jpeg", "train.steps=1", "reward.name=jpeg_compressibility")
    assert row["grad_norm"] > 0 and row["reward_std"] > 0 and row["logprob_abs_diff"] <= 1e-6


def test_edit_folder_without_an_edit_file_is_one_error(folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--recipe", "qwen_image_edit_flow_grpo", f"model.path={folder}", *TINY,
                 f"train.output_dir={out}", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "is an edit pipeline folder" in err and "data.prompts=FILE.jsonl" in err and "Traceback" not in err
    assert not out.exists()
