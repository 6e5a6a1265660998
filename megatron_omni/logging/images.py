"""Pictures a run leaves in its folder: sample grids and the reward curve (PNG)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def image_grid(images_NHW: torch.Tensor, path: Path, columns: int = 8, scale: int = 4) -> Path:
    """Grayscale images in [0, 1], [N, H, W], tiled `columns` wide with a 1-px border, upscaled."""
    n, h, w = images_NHW.shape
    rows = math.ceil(n / columns)
    canvas = np.ones(((h + 1) * rows + 1, (w + 1) * columns + 1), dtype=np.float32)
    for i, img in enumerate(images_NHW.clamp(0, 1).cpu().numpy()):
        r, c = divmod(i, columns)
        canvas[1 + r * (h + 1): 1 + r * (h + 1) + h, 1 + c * (w + 1): 1 + c * (w + 1) + w] = img
    pic = Image.fromarray((canvas * 255).astype(np.uint8)).resize((canvas.shape[1] * scale, canvas.shape[0] * scale),
                                                                   Image.NEAREST)
    pic.save(path)
    return path


def curve_plot(steps: list[int], series: dict[str, list[float]], path: Path, title: str) -> Path:
    """One PNG with a line per series (e.g. the training reward and the held-out judge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, values in series.items():
        ax.plot(steps[: len(values)], values, label=name, marker="o", markersize=2)
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
