"""The two digit classifiers behind the digit rewards, trained on scikit-learn's ``load_digits``.

Two *independent* models, so that a policy that learns to fool the training reward is exposed by the
judge: they share no weights, no architecture and no training images.

- **reward**: a small CNN (torch, ≈ 42 k parameters) on 16×16 images — batched on any device, fast.
- **judge**: an RBF-kernel SVC on the image area-pooled to 8×8, with sigmoid-calibrated probabilities
  (``CalibratedClassifierCV``; ``SVC(probability=True)`` is deprecated from scikit-learn 1.9).  The
  pooling also makes it blind to pixel-level patterns a policy could use to game a 16×16 CNN.

Data: the 1,797 8×8 digits (values 0..16, ink bright) scaled to [0, 1] and upsampled to 16×16 by
bilinear interpolation (``align_corners=False``), the pixel task of :mod:`megatron_omni.data.digits`.
A fixed stratified split holds out 25 % as the test split both models are scored on; the rest is
halved, the reward trains on one half and the judge on the other.  Training is seeded (≈ 1 s for the
CNN, 0.1 s for the SVC) and both models are cached on disk, keyed by a recipe version.
"""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_SIZE = 16
RECIPE = "v1"  # bump when the data split, the models or their training change: old caches are ignored
SEED = 0


def default_cache_dir() -> Path:
    """$MEGATRON_OMNI_CACHE/rewards/digits, default ~/.cache/megatron_omni/rewards/digits."""
    root = os.environ.get("MEGATRON_OMNI_CACHE") or Path.home() / ".cache" / "megatron_omni"
    return Path(root) / "rewards" / "digits"


@dataclass
class DigitSplit:
    """load_digits as 16×16 float images in [0, 1] ([N, 16, 16]) and labels [N], with index splits."""
    images: torch.Tensor
    labels: np.ndarray
    reward_train: np.ndarray
    judge_train: np.ndarray
    test: np.ndarray


def load_digit_split() -> DigitSplit:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_B1HW = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    x_BHW = F.interpolate(x_B1HW, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)[:, 0]
    y = data.target
    train, test = train_test_split(np.arange(len(y)), test_size=0.25, random_state=SEED, stratify=y)
    reward_train, judge_train = train_test_split(train, test_size=0.5, random_state=SEED, stratify=y[train])
    return DigitSplit(x_BHW, y, np.sort(reward_train), np.sort(judge_train), np.sort(test))


def pool_to_8x8(images_BHW: torch.Tensor) -> np.ndarray:
    """The judge's features: 16×16 → 8×8 by 2×2 averaging, flattened to [N, 64] float64."""
    return F.avg_pool2d(images_BHW[:, None].float(), 2).flatten(1).double().cpu().numpy()


class DigitCNN(nn.Module):
    """[N, 16, 16] in [0, 1] → logits [N, 10].  Two conv+pool stages (16→8→4 px), then an MLP."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images_BHW: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images_BHW[:, None]))


def _train_cnn(split: DigitSplit, epochs: int = 30, batch: int = 64, lr: float = 3e-3) -> DigitCNN:
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG stream
        torch.manual_seed(SEED)
        model = DigitCNN()
    generator = torch.Generator().manual_seed(SEED)
    x, y = split.images[split.reward_train], torch.as_tensor(split.labels[split.reward_train])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch):
            idx = order[start:start + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def _train_judge(split: DigitSplit) -> Any:
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.svm import SVC

    judge = CalibratedClassifierCV(SVC(C=10.0, gamma="scale"), method="sigmoid", cv=5, ensemble=False)
    return judge.fit(pool_to_8x8(split.images[split.judge_train]), split.labels[split.judge_train])


def _atomic_write(path: Path, write) -> None:
    """Write to a temporary file and rename, so concurrent runs never read a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


@dataclass
class TrainedDigitModel:
    """A classifier with what it was measured at: accuracy on the held-out test split (450 images)."""
    model: Any
    test_accuracy: float
    train_seconds: float  # 0.0 when loaded from the cache
    path: Path


def _accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float((probs.argmax(-1) == labels).mean())


def load_or_train_cnn(cache_dir: str | os.PathLike | None = None) -> TrainedDigitModel:
    path = Path(cache_dir or default_cache_dir()) / f"digit_cnn_{RECIPE}.pt"
    if path.is_file():
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model = DigitCNN()
        model.load_state_dict(blob["state_dict"])
        return TrainedDigitModel(model.eval(), blob["test_accuracy"], 0.0, path)
    split, start, threads = load_digit_split(), time.perf_counter(), torch.get_num_threads()
    # one intra-op thread: these tiny convolutions gain nothing from more, and on a busy machine
    # spinning OpenMP workers slowed training from ~2 s to a minute (measured on 2 shared cores)
    torch.set_num_threads(1)
    try:
        model = _train_cnn(split)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = _accuracy(model(split.images[split.test]).numpy(), split.labels[split.test])
    _atomic_write(path, lambda p: torch.save({"state_dict": model.state_dict(), "test_accuracy": accuracy}, p))
    return TrainedDigitModel(model, accuracy, seconds, path)


def load_or_train_judge(cache_dir: str | os.PathLike | None = None) -> TrainedDigitModel:
    import sklearn

    # a pickled scikit-learn model is only safe to load with the version that wrote it
    path = Path(cache_dir or default_cache_dir()) / f"digit_judge_svc_{RECIPE}_sklearn{sklearn.__version__}.pkl"
    if path.is_file():
        with open(path, "rb") as f:
            blob = pickle.load(f)  # our own cache file, written below
        return TrainedDigitModel(blob["model"], blob["test_accuracy"], 0.0, path)
    split, start = load_digit_split(), time.perf_counter()
    judge = _train_judge(split)
    seconds = time.perf_counter() - start
    accuracy = _accuracy(judge.predict_proba(pool_to_8x8(split.images[split.test])), split.labels[split.test])

    def write(p: Path) -> None:
        with open(p, "wb") as f:
            pickle.dump({"model": judge, "test_accuracy": accuracy}, f)
    _atomic_write(path, write)
    return TrainedDigitModel(judge, accuracy, seconds, path)
