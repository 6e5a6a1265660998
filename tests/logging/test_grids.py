"""Labelled sample grids: the layout (tiles upscaled, in place, pixel for pixel), labels wrapped and cut so the
score line always shows, the text really rendered (tesseract reads it back), clear errors; image_grid intact."""
import numpy as np
import pytest
import torch
from PIL import Image, ImageFont, ImageOps

from megatron_omni.logging.grids import GAP, labelled_grid, wrap_label
from megatron_omni.logging.images import image_grid
from tests.rewards.test_ocr import needs_tesseract

PROMPT = ('A high-altitude mountain summit with a wooden signpost clearly marked "Elevation 8000 Feet", '
          "surrounded by rocky terrain and a backdrop of distant, snow-capped peaks under a clear blue sky.")


def load(path) -> np.ndarray:
    image = Image.open(path)
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def test_gray_digits_layout(tmp_path):
    images = torch.rand(5, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = [f"{PROMPT}\nreward 0.8{i}" for i in range(4)] + [""]
    grid = load(labelled_grid(images, labels, tmp_path / "g.png", columns=3))
    tile, cell_w = 16 * 12, 16 * 12 + GAP  # 16 px upscaled x12 to the 192 px minimum tile width
    assert grid.shape[1] == 3 * cell_w + GAP and grid.shape[2] == 3
    cell_h = (grid.shape[0] - GAP) / 2
    assert cell_h == int(cell_h) and cell_h - tile - GAP >= 4 * 16, "two rows, room for four lines of text"
    cell_h = int(cell_h)
    for i in range(5):
        r, c = divmod(i, 3)
        x, y = GAP + c * cell_w, GAP + r * cell_h
        expected = np.round(images[i].numpy() * 255).astype(np.uint8).repeat(12, 0).repeat(12, 1)
        np.testing.assert_array_equal(grid[y:y + tile, x:x + tile], np.stack([expected] * 3, -1))
        strip = grid[y + tile:y + cell_h - GAP, x:x + tile]
        assert (strip.min() < 64) == (i < 4), f"tile {i}: text under a labelled tile only"
    assert (grid[GAP + cell_h:, GAP + 2 * cell_w:] == 255).all(), "the sixth cell stays empty"


def test_rgb_nchw_and_default_columns(tmp_path):
    images = torch.zeros(3, 3, 64, 96)
    images[:, 0] = 1.0  # pure red
    grid = load(labelled_grid(images, ["a", "b", "c"], tmp_path / "g.png"))
    assert grid.shape[1] == 2 * (192 + GAP) + GAP  # ceil(sqrt(3)) = 2 columns, 96 px upscaled x2
    assert (grid[GAP:GAP + 128, GAP:GAP + 192] == [255, 0, 0]).all()
    big = load(labelled_grid(np.full((2, 1, 300, 250), 0.5, np.float32), ["x", "y"], tmp_path / "b.png",
                             columns=1))
    assert big.shape[1] == 250 + 2 * GAP and (big[GAP:GAP + 300, GAP:GAP + 250] == 128).all()  # not scaled


def test_wrap_label_cuts_the_prompt_and_keeps_the_scores():
    font = ImageFont.load_default(size=16)
    lines = wrap_label(f"{PROMPT}\nreward 0.83", font, 188, max_lines=3)
    assert len(lines) == 3 and lines[-1] == "reward 0.83" and lines[1].endswith("...")
    assert all(font.getlength(line) <= 188 for line in lines)
    assert " ".join(lines[:2]).removesuffix("...").rstrip() in PROMPT
    assert wrap_label("short", font, 188, 3) == ["short"] and wrap_label("", font, 188, 3) == [""]
    long_word = wrap_label("x" * 200, font, 100, 50)  # a word wider than the tile is broken, not lost
    assert "".join(long_word) == "x" * 200 and all(font.getlength(line) <= 100 for line in long_word)


def test_errors_name_the_bad_value(tmp_path):
    with pytest.raises(ValueError, match=r"2 labels for 3 images; expected one label per image"):
        labelled_grid(torch.rand(3, 8, 8), ["a", "b"], tmp_path / "g.png")
    with pytest.raises(ValueError, match=r"images of shape \(3, 2, 8, 8\); expected \[N, H, W\] or \[N, C, H, W\]"):
        labelled_grid(torch.rand(3, 2, 8, 8), ["a"] * 3, tmp_path / "g.png")
    with pytest.raises(TypeError, match=r"images of dtype uint8; expected floats in \[0, 1\]"):
        labelled_grid(np.zeros((1, 8, 8), np.uint8), ["a"], tmp_path / "g.png")


def test_image_grid_unchanged(tmp_path):
    """The run logger's grayscale grid (its existing callers) still draws as before: 1-px borders, x4."""
    pic = Image.open(image_grid(torch.ones(10, 16, 16) * 0.5, tmp_path / "g.png", columns=8))
    assert pic.size == ((17 * 8 + 1) * 4, (17 * 2 + 1) * 4) and pic.mode == "L"


@needs_tesseract
def test_tesseract_reads_the_labels(tmp_path):
    from megatron_omni.rewards import build_reward

    images = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(1))
    grid = Image.open(labelled_grid(images, ["reward 0.50", f"{PROMPT}\nreward 0.83"], tmp_path / "g.png",
                                    columns=2))
    tile, cell_w = 192, 192 + GAP

    def strip(column: int) -> Image.Image:  # a label strip with a white margin, as tesseract likes text
        x = GAP + column * cell_w
        return ImageOps.expand(grid.crop((x, GAP + tile, x + tile, grid.height - GAP)), 16, fill="white")

    assert build_reward("ocr", psm=7).read_text(strip(0)).strip() == "reward 0.50"  # one line, default font
    text = build_reward("ocr", psm=6).read_text(strip(1))
    assert text.split("\n")[-2:] == ["reward 0.83", ""] and "mountain" in text, repr(text)
