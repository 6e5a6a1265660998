"""OCR reward: how closely the text an OCR engine reads in the image matches the text the prompt quotes.

score = 1 − min(Levenshtein(ocr, target), |target|) / |target|, both lower-cased with spaces removed
(Flow-GRPO's text-rendering reward; flow_grpo reads with PaddleOCR, we read with Debian's tesseract
through ``tesserocr``, ≈ 10 ms per image, which releases the GIL so reward threads run in parallel).
The target is the text between double quotes in the prompt (``... a sign reading "Open Late" ...``),
the format of Flow-GRPO's OCR prompt sets; several quoted spans are joined with a space.

Needs: ``apt-get install tesseract-ocr`` (the engine's English model, ``eng.traineddata``) and
``pip install tesserocr rapidfuzz``.  The tesserocr wheel bundles the library but no models, so the
tessdata folder is located here (or passed as ``tessdata=``) and handed to every engine instance.
"""
from __future__ import annotations

import glob
import os
import re
import threading
from typing import Any, Sequence

import numpy as np

from megatron_omni.rewards.images import to_pil_list
from megatron_omni.rewards.registry import register_reward

_QUOTED = re.compile(r'"([^"]*)"')
_TESSDATA_GLOBS = ("/usr/share/tesseract-ocr/*/tessdata", "/usr/share/tessdata", "/usr/local/share/tessdata",
                   "/opt/homebrew/share/tessdata", "/usr/local/share/tesseract-ocr/*/tessdata")


def ocr_target(prompt: str) -> str:
    """The text ``prompt`` asks to render: its double-quoted span(s), joined by a space."""
    spans = [s for s in _QUOTED.findall(prompt) if s.strip()]
    if not spans:
        raise ValueError(f"OCR prompt {prompt!r} quotes no text; expected the text to render in double "
                         f'quotes, e.g. \'a shop sign reading "Open Late"\'')
    return " ".join(spans)


def _normalise(text: str) -> str:
    return "".join(text.lower().split())  # lower case, no whitespace of any kind (spaces, newlines)


def ocr_score(ocr_text: str, target: str) -> float:
    """1 − min(Levenshtein(ocr, target), |target|)/|target| on lower-cased, space-free strings; in [0, 1]."""
    from rapidfuzz.distance import Levenshtein

    got, want = _normalise(ocr_text), _normalise(target)
    if not want:
        raise ValueError(f"OCR target {target!r} is empty after removing spaces; expected visible text")
    return 1.0 - min(Levenshtein.distance(got, want), len(want)) / len(want)


def find_tessdata(lang: str = "eng") -> str:
    """The tessdata folder holding ``<lang>.traineddata``: $TESSDATA_PREFIX, else the usual system paths."""
    prefix = os.environ.get("TESSDATA_PREFIX")
    # tesseract >= 4 reads TESSDATA_PREFIX as the tessdata folder itself, 3.x as the folder above it
    candidates = [prefix, os.path.join(prefix, "tessdata")] if prefix else []
    for pattern in _TESSDATA_GLOBS:
        candidates += sorted(glob.glob(pattern), reverse=True)  # newest tesseract major version first
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, f"{lang}.traineddata")):
            return folder
    raise FileNotFoundError(
        f"no tessdata folder with {lang}.traineddata (looked in {candidates or list(_TESSDATA_GLOBS)}); "
        f"expected Debian's tesseract-ocr (`apt-get install tesseract-ocr`, or `make install` as root), "
        f"or pass tessdata=<folder> / set TESSDATA_PREFIX")


@register_reward("ocr")
class OcrReward:
    """Tesseract OCR reward.  One engine per thread (an engine is not thread-safe; creating one costs
    ≈ 50 ms, so each worker thread keeps its own).  ``psm`` is tesseract's page segmentation mode
    (3 = automatic layout, the default; 7 = a single text line)."""

    def __init__(self, tessdata: str | None = None, lang: str = "eng", psm: int = 3):
        try:
            import rapidfuzz  # noqa: F401  (fail at build time, not inside a reward worker)
            import tesserocr  # noqa: F401
        except ImportError as err:
            raise ImportError(f"the OCR reward needs {err.name}: `pip install tesserocr rapidfuzz` "
                              f"(and `apt-get install tesseract-ocr` for the English model)") from err
        self.tessdata = tessdata or find_tessdata(lang)
        if not os.path.isfile(os.path.join(self.tessdata, f"{lang}.traineddata")):
            raise FileNotFoundError(f"tessdata={self.tessdata!r} has no {lang}.traineddata; expected the "
                                    f"folder that holds it (e.g. {find_tessdata.__name__}())")
        if psm not in range(14):
            raise ValueError(f"psm={psm!r}: expected a tesseract page segmentation mode 0..13")
        self.lang, self.psm = lang, psm
        self._local = threading.local()

    def _engine(self):
        engine = getattr(self._local, "engine", None)
        if engine is None:
            import tesserocr

            # tesserocr wants the folder with a trailing separator (it appends the file name to it)
            engine = tesserocr.PyTessBaseAPI(path=os.path.join(self.tessdata, ""), lang=self.lang, psm=self.psm)
            self._local.engine = engine
        return engine

    def read_text(self, image) -> str:
        """The text tesseract reads in one PIL image."""
        engine = self._engine()
        engine.SetImage(image.convert("RGB") if image.mode not in ("L", "RGB") else image)
        return engine.GetUTF8Text()

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None) -> np.ndarray:
        targets = [ocr_target(p) for p in prompts]  # bad prompts fail before any OCR work
        return np.asarray([ocr_score(self.read_text(im), t) for im, t in zip(to_pil_list(images), targets)])
