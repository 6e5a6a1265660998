"""Labelled sample grids: each image with its text under it (the prompt, wrapped or cut, and e.g. its reward).

``labelled_grid(images, labels, path)`` tiles RGB or grayscale images in [0, 1] and renders each label in a
white strip below its tile with PIL's default font (``ImageFont.load_default(size=...)``: a scalable font
since Pillow 10.1).  A label's ``\\n`` starts a new paragraph; the first paragraph (the prompt) is the one cut
with "..." when the label needs more than ``max_lines`` lines, so the later ones (the scores) always show.
Small images (the 16x16 digits) are upscaled by a whole factor, nearest neighbour, until a tile is
``min_tile`` pixels wide, room for a readable line of text.  Legend: N images, C channels, H x W pixels.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

GAP = 4  # pixels between tiles and around the grid
BACKGROUND, INK = (255, 255, 255), (0, 0, 0)
ELLIPSIS = "..."


def as_uint8_NHWC(images) -> np.ndarray:
    """[N, H, W] or [N, C, H, W] (C = 1 or 3) floats in [0, 1], a tensor or an array -> uint8 [N, H, W, 3]."""
    array = images.detach().float().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"images of dtype {array.dtype}; expected floats in [0, 1]")
    if array.ndim == 3:
        array = array[:, None]
    if array.ndim != 4 or array.shape[1] not in (1, 3):
        raise ValueError(f"images of shape {tuple(array.shape)}; expected [N, H, W] or [N, C, H, W] with C = 1 or 3")
    array = np.nan_to_num(array.clip(0.0, 1.0), nan=0.0).transpose(0, 2, 3, 1)  # NCHW -> NHWC
    return np.round(np.broadcast_to(array, array.shape[:3] + (3,)) * 255).astype(np.uint8)


def wrap_label(text: str, font: ImageFont.ImageFont, width: int, max_lines: int) -> list[str]:
    """The lines of ``text`` that fit ``width`` pixels, at most ``max_lines``: the first paragraph cut
    with "..." when too long, the others kept whole (while they fit)."""
    paragraphs = [_wrap(p, font, width) for p in text.split("\n")]
    head, tail = paragraphs[0], [line for p in paragraphs[1:] for line in p]
    room = max(1, max_lines - len(tail))
    if len(head) > room:
        head = head[: room - 1] + [_ellipsize(" ".join(head[room - 1:]), font, width)]
    return (head + tail)[:max_lines]


def labelled_grid(images, labels: Sequence[str], path: str | Path, columns: int | None = None, *,
                  min_tile: int = 192, font_size: int | None = None, max_lines: int = 4) -> Path:
    """Save ``images`` ([N, H, W] gray or [N, C, H, W], floats in [0, 1]) as one RGB PNG, ``columns`` tiles
    wide (default: about square), each with ``labels[i]`` under it.  The font is ``font_size`` pixels
    (default: a twelfth of the tile width, 14 to 24).  Returns ``path``."""
    pixels_NHWC = as_uint8_NHWC(images)
    n, h, w, _ = pixels_NHWC.shape
    if len(labels) != n:
        raise ValueError(f"{len(labels)} labels for {n} images; expected one label per image")
    columns = columns or math.ceil(math.sqrt(n))
    if columns < 1:
        raise ValueError(f"columns={columns!r}: expected a positive number of tiles per row")
    scale = max(1, math.ceil(min_tile / w))
    tile_w, tile_h = w * scale, h * scale
    font = ImageFont.load_default(size=font_size or min(24, max(14, tile_w // 12)))
    line_h = _line_height(font)
    lines = [wrap_label(str(label), font, tile_w - 4, max_lines) for label in labels]
    strip_h = max(len(ls) for ls in lines) * line_h + GAP
    rows = math.ceil(n / columns)
    cell_w, cell_h = tile_w + GAP, tile_h + strip_h + GAP
    canvas = Image.new("RGB", (columns * cell_w + GAP, rows * cell_h + GAP), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for i, (pixels_HWC, tile_lines) in enumerate(zip(pixels_NHWC, lines)):
        r, c = divmod(i, columns)
        x, y = GAP + c * cell_w, GAP + r * cell_h
        canvas.paste(Image.fromarray(pixels_HWC).resize((tile_w, tile_h), Image.NEAREST), (x, y))
        for k, line in enumerate(tile_lines):
            draw.text((x + 2, y + tile_h + GAP // 2 + k * line_h), line, fill=INK, font=font)
    path = Path(path)
    canvas.save(path, format="PNG")
    return path


def _line_height(font: ImageFont.ImageFont) -> int:
    top, bottom = font.getbbox("Ag|")[1::2]  # ascender to descender of the tallest glyphs
    return bottom + max(2, (bottom - top) // 4)  # the text's offset from y plus its height, and some leading


def _wrap(text: str, font: ImageFont.ImageFont, width: int) -> list[str]:
    """Greedy word wrap to ``width`` pixels; a word wider than a line is broken between characters."""
    lines, current = [], ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if font.getlength(candidate) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        while len(word) > 1 and font.getlength(word) > width:
            cut = 1  # the longest start of the word that fits, at least one character
            while font.getlength(word[: cut + 1]) <= width:
                cut += 1
            lines.append(word[:cut])
            word = word[cut:]
        current = word
    return lines + [current] if current else lines or [""]


def _ellipsize(text: str, font: ImageFont.ImageFont, width: int) -> str:
    """``text`` cut at the end, with "...", to fit ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text.rstrip() + ELLIPSIS) > width:
        text = text[:-1]
    return text.rstrip() + ELLIPSIS
