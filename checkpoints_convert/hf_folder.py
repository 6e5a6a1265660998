"""diffusers-format transformer folders: ``config.json`` + safetensors shard(s) + index.

Reading is lazy (safetensors memory-maps; one tensor at a time).  Writing streams tensors into
shards of at most ``max_shard_bytes`` and is atomic: everything goes to a hidden temporary folder
beside the target, which is renamed into place only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG = "config.json"
SINGLE = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # diffusers' default max_shard_size ("5GB" as 5 GiB is close enough)


class ConversionError(ValueError):
    """Bad input to a conversion: one clear message, nothing written."""


class HFFolder:
    """Read access to a diffusers model folder (the ``transformer/`` subfolder of a pipeline)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"HF folder {self.path} does not exist or is not a directory")
        cfg = self.path / CONFIG
        if not cfg.is_file():
            raise ConversionError(f"{cfg} is missing: expected a diffusers model folder with config.json")
        self.config = json.loads(cfg.read_text())
        self._file_of = self._index()
        self._handles: dict[str, object] = {}

    def _index(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no 'weight_map' object")
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise ConversionError(f"{index} lists shard files that are missing: {missing}")
            return dict(weight_map)
        single = self.path / SINGLE
        if not single.is_file():
            raise ConversionError(f"{self.path} holds neither {SINGLE} nor {INDEX}")
        with safe_open(single, framework="pt") as f:
            return {k: SINGLE for k in f.keys()}

    def keys(self) -> list[str]:
        return list(self._file_of)

    def _handle(self, name: str):
        if name not in self._file_of:
            raise ConversionError(f"tensor {name!r} is missing from {self.path}")
        fname = self._file_of[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.path / fname, framework="pt")
        return self._handles[fname]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())


@contextmanager
def atomic_output_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` on success and vanishes on any error."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output {out} already exists and is not an empty folder; choose a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_hf_folder(folder: Path, config: dict, tensors: Iterable[tuple[str, torch.Tensor]],
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Write ``config.json`` and the tensors (streamed) into ``folder``; returns the shard count.

    One shard is written as ``diffusion_pytorch_model.safetensors``; several as
    ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` plus the index, as diffusers does.
    """
    current: dict[str, torch.Tensor] = {}
    size, files = 0, []

    def flush(shard: dict[str, torch.Tensor]) -> None:
        path = folder / f"shard-{len(files):05d}.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        files.append((path, list(shard)))

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += nbytes
    if current or not files:
        flush(current)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if len(files) == 1:
        os.replace(files[0][0], folder / SINGLE)
        return 1
    weight_map, total = {}, 0
    for k, (path, names) in enumerate(files, start=1):
        final = f"diffusion_pytorch_model-{k:05d}-of-{len(files):05d}.safetensors"
        os.replace(path, folder / final)
        weight_map.update({n: final for n in names})
        total += (folder / final).stat().st_size
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return len(files)
