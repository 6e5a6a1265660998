"""OCR reward on the real engine (Debian's tesseract through tesserocr): rendered prompt texts score
near 1; blank images and other texts near 0; prompts without quoted text fail clearly."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.data.prompts import ocr_prompts_path
from megatron_omni.rewards import build_reward
from megatron_omni.rewards.ocr import find_tessdata, ocr_score, ocr_target

# the packaged copy of Flow-GRPO's OCR set (tests/data/test_prompts.py: byte-equal to ../shared/data's)
PROMPTS = ocr_prompts_path()
FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
FONT_PX = 64


def _engine_present() -> bool:
    try:
        import tesserocr  # noqa: F401
        find_tessdata()
        return True
    except (ImportError, FileNotFoundError):
        return False


needs_tesseract = pytest.mark.skipif(not _engine_present(),
                                     reason="tesseract-ocr (apt) or tesserocr (pip) missing; `make install` as root")


@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


@pytest.fixture(scope="module")
def prompts():
    """Every 50th prompt of Flow-GRPO's OCR test set (21 of 1,017): short to long texts, digits, punctuation."""
    assert PROMPTS.is_file(), f"{PROMPTS} is missing: expected the packaged OCR prompt set"
    return PROMPTS.read_text(encoding="utf-8").splitlines()[::50]


def render(text: str) -> Image.Image:
    """Black text on white at 64 px in DejaVu Sans (PIL's built-in scalable font where DejaVu is absent)."""
    font = ImageFont.truetype(str(FONT), FONT_PX) if FONT.is_file() else ImageFont.load_default(size=FONT_PX)
    width = int(font.getlength(text)) + 2 * FONT_PX
    image = Image.new("RGB", (width, 2 * FONT_PX), "white")
    ImageDraw.Draw(image).text((FONT_PX, FONT_PX // 2), text, fill="black", font=font)
    return image


def test_ocr_target_is_the_quoted_text():
    assert ocr_target('a neon sign reading "Open Late" above the door') == "Open Late"
    assert ocr_target('a mug saying "Good" and a plate saying "Morning"') == "Good Morning"
    with pytest.raises(ValueError, match=r"OCR prompt 'a red barn at dusk' quotes no text; expected .*double quotes"):
        ocr_target("a red barn at dusk")
    with pytest.raises(ValueError, match="quotes no text"):
        ocr_target('an empty sign ""')


def test_ocr_score_formula():
    assert ocr_score("OPEN LATE\n", "Open Late") == 1.0  # case, spaces and newlines ignored
    assert ocr_score("Opon Late", "Open Late") == pytest.approx(1 - 1 / 8)  # 1 edit of 8 letters
    assert ocr_score("", "Open Late") == 0.0
    assert ocr_score("a very long unrelated paragraph of text", "Hi") == 0.0  # distance capped at |target|


@needs_tesseract
def test_rendered_prompt_texts_score_near_one(ocr, prompts, report):
    images = [render(ocr_target(p)) for p in prompts]
    scores = ocr(images, prompts, None)
    worst = int(np.argmin(scores))
    report(f"{len(prompts)} rendered prompt texts: mean {scores.mean():.3f}, min {scores.min():.3f} "
           f"({ocr_target(prompts[worst])!r} read as {ocr.read_text(images[worst]).strip()!r}), "
           f"exact {np.mean(scores == 1.0):.0%}")
    assert scores.mean() >= 0.9


@needs_tesseract
def test_blank_and_wrong_text_score_near_zero(ocr, prompts, report):
    blank = ocr([Image.new("RGB", (512, 128), "white")] * 3 + [Image.new("RGB", (512, 128), "black")],
                prompts[:4], None)
    others = prompts[1:] + prompts[:1]  # each image shows the next prompt's text
    wrong = ocr([render(ocr_target(p)) for p in others], prompts, None)
    report(f"blank images: max {blank.max():.3f}; another prompt's text: mean {wrong.mean():.3f}, "
           f"max {wrong.max():.3f}")
    assert blank.max() == 0.0
    assert wrong.mean() <= 0.3


@needs_tesseract
def test_accepts_uint8_tensor_and_names_bad_prompt(ocr):
    import torch

    image = render("Open Late")
    batch = torch.from_numpy(np.stack([np.asarray(image)] * 2))  # uint8 [2, H, W, 3]
    assert ocr(batch, ['sign "Open Late"'] * 2, None).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="'a sign with no quotes' quotes no text"):
        ocr([image, image], ['sign "Open Late"', "a sign with no quotes"], None)


def test_missing_tessdata_is_a_clear_error(tmp_path):
    pytest.importorskip("tesserocr")
    with pytest.raises(FileNotFoundError, match=r"has no eng.traineddata; expected the folder"):
        build_reward("ocr", tessdata=str(tmp_path))
