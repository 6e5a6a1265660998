"""Prompt and edit datasets: .txt / .jsonl loading, errors naming the file and the line, lazily read edit
images, a held-out split that is deterministic and disjoint, the RL loop's prompt draw, the packaged OCR set."""
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from megatron_omni.data.prompts import (DatasetError, DatasetFileMissing, EditDataset, PromptDataset,
                                        PromptRecord, SplitConfig, load_ocr_prompts, ocr_prompts_path, split)
from megatron_omni.rewards.ocr import ocr_target
from tests.rewards.test_ocr import needs_tesseract, render

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "ocr_prompts" / "prompts.txt"


def write_jsonl(path: Path, rows) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_txt_one_prompt_per_non_empty_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('\ufeff  a sign reading "Open"  \n\n\t\na cat\r\nthe end', encoding="utf-8")  # BOM, CRLF
    ds = PromptDataset.from_file(path)
    assert ds.prompts == ['a sign reading "Open"', "a cat", "the end"]
    assert [r.line for r in ds] == [1, 4, 5]
    assert ds.negative_prompts == [None] * 3 and ds.metadata == [{}] * 3 and len(ds) == 3


def test_jsonl_fields_and_metadata(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "a fox", "negative_prompt": "blurry", "seed": 7, "metadata": {"tag": "animal"}, "split": "x"},
        "",
        {"prompt": "  kept verbatim, a raw U+2028 \u2028 inside "},
    ])
    first, second = PromptDataset.from_file(path)
    assert first == PromptRecord(prompt="a fox", negative_prompt="blurry", seed=7,
                                 metadata={"tag": "animal", "split": "x"}, line=1)
    assert second.prompt == "  kept verbatim, a raw U+2028 \u2028 inside " and second.line == 3  # JSON: as given
    assert second.seed is None


@pytest.mark.parametrize("line, message", [
    ("{bad json", r"not valid JSON \(Expecting property name .* column 2\); expected one JSON object per line"),
    ("[1, 2]", r"an array \[1, 2\]; expected a JSON object per line"),
    ('"a prompt"', r'a string "a prompt"; expected a JSON object'),
    ('{"text": "a fox"}', r"\"prompt\" is missing \(the line has \['text'\]\); expected a non-empty string"),
    ('{"prompt": 3}', r'"prompt" is a number 3; expected a non-empty string'),
    ('{"prompt": null}', r'"prompt" is null; expected a non-empty string'),
    ('{"prompt": "  "}', r'"prompt" is a string "  "; expected a non-empty string'),
    ('{"prompt": "a", "negative_prompt": ["x"]}', r'"negative_prompt" is an array \["x"\]; expected a string'),
    ('{"prompt": "a", "seed": -1}', r'"seed" is a number -1; expected an integer >= 0'),
    ('{"prompt": "a", "seed": true}', r'"seed" is a boolean true; expected an integer >= 0'),
    ('{"prompt": "a", "metadata": 1}', r'"metadata" is a number 1; expected a JSON object'),
    ('{"prompt": "a", "k": 1, "metadata": {"k": 2}}', r"fields \['k'\] are given both at the top level"),
])
def test_malformed_jsonl_line_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "", line, {"prompt": "after"}])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:3: ") + message):
        PromptDataset.from_file(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetFileMissing, match=r"prompt file .*nope.txt does not exist; expected a .txt or .jsonl"):
        PromptDataset.from_file(tmp_path / "nope.txt")
    assert issubclass(DatasetFileMissing, FileNotFoundError) and issubclass(DatasetFileMissing, ValueError)
    for name, content in (("empty.txt", ""), ("blank.jsonl", "\n  \n\t\n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / name}: no prompts (the file is empty")):
            PromptDataset.from_file(tmp_path / name)
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(DatasetError, match=r"has suffix '.csv'; expected .txt or .jsonl"):
        PromptDataset.from_file(tmp_path / "p.csv")
    with pytest.raises(DatasetError, match=r"is not a file"):
        PromptDataset.from_file(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.txt:2: byte 0xe9 is not UTF-8"):
        PromptDataset.from_file(tmp_path / "latin1.txt")


def save_png(path: Path, value: int, mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (8, 6), value if mode == "L" else (value, 0, 0)).save(path)
    return path


def test_edit_dataset_resolves_paths_and_reads_images_lazily(tmp_path):
    save_png(tmp_path / "data" / "images" / "cat.png", 200)
    absolute = save_png(tmp_path / "elsewhere" / "gray.png", 50, mode="L")
    path = write_jsonl(tmp_path / "data" / "edits.jsonl", [
        {"prompt": "make it blue", "image": "images/cat.png", "negative_prompt": "red", "strength": 0.5},
        {"prompt": "make it blue", "image": str(absolute)},
    ])
    ds = EditDataset.from_file(path)
    assert ds[0].image_path == (tmp_path / "data" / "images" / "cat.png").resolve()
    assert ds[0].negative_prompt == "red" and ds[0].metadata == {"strength": 0.5}  # "image" is not metadata
    gray = ds.image(1)
    assert gray.mode == "RGB" and gray.size == (8, 6) and gray.getpixel((0, 0)) == (50, 50, 50)
    save_png(tmp_path / "data" / "images" / "cat.png", 10)  # read when asked for, not at load
    assert ds.image(0).getpixel((0, 0)) == (10, 0, 0)
    (tmp_path / "data" / "images" / "cat.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=r"cat.png \(line 1\) cannot be read: .*; expected an image file"):
        ds.image(0)


def test_edit_dataset_missing_image_names_line_and_path(tmp_path):
    save_png(tmp_path / "a.png", 1)
    path = write_jsonl(tmp_path / "edits.jsonl", [{"prompt": "x", "image": "a.png"}, "",
                                                  {"prompt": "y", "image": "sub/missing.png"}])
    with pytest.raises(DatasetFileMissing, match=re.escape(
            f"{path}:3: image 'sub/missing.png' does not exist (looked for {tmp_path / 'sub' / 'missing.png'})")):
        EditDataset.from_file(path)
    write_jsonl(path, [{"prompt": "x"}])
    with pytest.raises(DatasetError, match=r"edits.jsonl:1: \"image\" is missing .*; expected the source image's path"):
        EditDataset.from_file(path)
    (tmp_path / "edits.txt").write_text("x\n")
    with pytest.raises(DatasetError, match=r"has suffix '.txt'; expected .jsonl"):
        EditDataset.from_file(tmp_path / "edits.txt")


def numbered(n: int) -> PromptDataset:
    return PromptDataset.from_prompts([f"prompt {i}" for i in range(n)])


def test_split_is_deterministic_disjoint_and_keeps_order():
    ds = numbered(200)
    train, held = split(ds, eval_fraction=0.1, seed=3)
    assert (len(train), len(held)) == (180, 20) and type(train) is PromptDataset
    assert set(train.prompts).isdisjoint(held.prompts) and set(train.prompts) | set(held.prompts) == set(ds.prompts)
    assert held.prompts == sorted(held.prompts, key=ds.prompts.index)  # the file's order on each side
    assert split(ds, eval_count=20, seed=3)[1].prompts == held.prompts  # the same permutation
    assert split(numbered(200), eval_fraction=0.1, seed=3)[1].prompts == held.prompts
    assert split(ds, eval_fraction=0.1, seed=4)[1].prompts != held.prompts
    shuffled = ds.prompts[:]
    random.Random(0).shuffle(shuffled)  # the split depends on the prompts, not on the file's order
    assert set(split(PromptDataset.from_prompts(shuffled), eval_count=20, seed=3)[1].prompts) == set(held.prompts)
    # pinned: the held-out set of a file must not move between versions (an eval curve would change meaning)
    assert split(numbered(10), eval_count=3, seed=0)[1].prompts == ["prompt 0", "prompt 2", "prompt 8"]


def test_split_keeps_repeated_prompts_on_one_side(tmp_path):
    ds = PromptDataset.from_prompts([f"p{i % 10}" for i in range(50)])  # each prompt five times
    train, held = split(ds, eval_count=2, seed=0)
    assert len(set(held.prompts)) == 2 and len(held) == 10 and set(train.prompts).isdisjoint(held.prompts)
    for image in ("a.png", "b.png"):
        save_png(tmp_path / image, 1)
    edits = EditDataset.from_file(write_jsonl(tmp_path / "e.jsonl", [
        {"prompt": f"edit {i % 3}", "image": "a.png" if i < 3 else "b.png"} for i in range(6)]))
    train, held = split(edits, eval_count=2, seed=1)  # the unit is the (instruction, image) pair
    assert type(held) is EditDataset and len(held) == 2 and len(train) == 4
    assert {r.split_key() for r in train}.isdisjoint(r.split_key() for r in held)


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"eval_fraction=None, eval_count=None: expected exactly one"),
    ({"eval_fraction": 0.1, "eval_count": 3}, r"expected exactly one"),
    ({"eval_fraction": 1.0}, r"eval_fraction=1.0: expected a fraction in \(0, 1\)"),
    ({"eval_count": 2.0}, r"eval_count=2.0: expected an integer"),
    ({"eval_count": 10}, r"eval split of 10 prompts .* out of 10 distinct prompts; expected 1 to 9"),
    ({"eval_count": 0}, r"expected 1 to 9"),
])
def test_split_settings_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        split(numbered(10), **kwargs)
    assert SplitConfig(eval_fraction=0.01).eval_size(10) == 1  # rounded, at least one


def test_sample_draws_like_the_rl_loop():
    """The loop's prompt draw (FlowGRPO.requests uses sample): a generator seeded by (seed, step) only, so a resumed
    run draws what an uninterrupted one would; pinned against the formula written out here."""
    import torch

    from megatron_omni.algorithms.flow_grpo import ALGORITHM
    from megatron_omni.config.recipes import get_recipe
    from megatron_omni.data.digits import GRID_FHW, prompt_for
    from megatron_omni.data.tasks import Task

    cfg = get_recipe("digits_flow_grpo")
    ds = PromptDataset.from_prompts([prompt_for(d) for d in range(10)])
    task = Task(name="digits", prompts=ds.prompts, img_fhw=GRID_FHW, encode=None, decode=None, text_dim=0,
                latent_channels=0)
    run = SimpleNamespace(cfg=cfg, task=task, family=cfg.model.family_impl)
    n, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    for step in (0, 1, 17):
        g = torch.Generator().manual_seed((cfg.train.seed * 1_000_003 + step * 10_007 - 1) % 2**63)
        want = [ds.prompts[i] for i in torch.randint(0, 10, (n,), generator=g).tolist()]
        assert [r.prompt for r in ds.sample(step, cfg.train.seed, n)] == want
        assert [r.prompt for r in ALGORITHM.requests(run, step)][::group] == want


def test_packaged_ocr_prompts_load_with_their_targets():
    path = ocr_prompts_path()
    assert path.parent == Path(__import__("megatron_omni.data").data.__file__).parent / "ocr_prompts"
    assert "MIT License" in (path.parent / "LICENSE").read_text() and (path.parent / "README.md").is_file()
    if SHARED_PROMPTS.is_file():
        assert path.read_bytes() == SHARED_PROMPTS.read_bytes(), "the packaged copy differs from shared/data"
    ds = load_ocr_prompts()
    assert len(ds) == 1018 and [r.line for r in ds] == list(range(1, 1019))
    targets = [ocr_target(p) for p in ds.prompts]
    assert targets[0] == "Spring Collection 2024" and all(2 <= len(t) <= 29 for t in targets)


def test_ocr_prompt_without_quoted_text_names_its_line(tmp_path):
    path = tmp_path / "ocr.txt"
    path.write_text('a sign reading "Open"\na sign with no text\n')
    with pytest.raises(DatasetError, match=r"ocr.txt:2: OCR prompt 'a sign with no text' quotes no text"):
        load_ocr_prompts(path)


@needs_tesseract
def test_ocr_reward_reads_the_packaged_targets():
    from megatron_omni.rewards import build_reward

    held = split(load_ocr_prompts(), eval_count=8, seed=0)[1]  # a fixed handful of the set
    images = [render(ocr_target(p)) for p in held.prompts]
    scores = build_reward("ocr")(images, held.prompts, held.metadata)
    assert scores.shape == (8,) and np.mean(scores) >= 0.9, list(zip(held.prompts, scores))
