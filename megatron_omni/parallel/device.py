"""Which accelerator this process runs on, and which torch.distributed backend goes with it.

One place decides the (device, backend) pair so that model code, process-group setup and tests agree:
CUDA pairs with NCCL, Ascend NPU (``torch_npu``) with HCCL, and plain CPU with gloo.  ``torch_npu`` is
imported only when it is asked about, because importing it patches torch on machines that have it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
ALLOWED_REQUESTS = ("auto", *BACKEND_FOR_DEVICE)


@dataclass(frozen=True)
class DeviceSpec:
    """A device type and its collective backend, e.g. ``DeviceSpec("cuda", "nccl")``."""

    type: str
    backend: str

    def torch_device(self, local_rank: int = 0) -> torch.device:
        """The device this rank computes on: ``cuda:<local_rank>``, ``npu:<local_rank>`` or ``cpu``."""
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, local_rank)


def _npu_available() -> bool:
    """True when ``torch_npu`` is installed and sees at least one NPU."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return torch.npu.is_available()


def available_devices() -> list[str]:
    """Device types usable in this process, best first; ``cpu`` is always last."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if _npu_available():
        found.append("npu")
    return [*found, "cpu"]


def select_device(requested: str = "auto") -> DeviceSpec:
    """Resolve ``requested`` ("auto", "cuda", "npu" or "cpu") to a DeviceSpec.

    "auto" takes CUDA if present, else an Ascend NPU, else the CPU.  An explicit request for a device
    that is not there is an error rather than a silent fallback: a run configured for GPUs must not
    quietly train on the CPU.
    """
    if requested not in ALLOWED_REQUESTS:
        raise ValueError(f"device {requested!r} is not one of {list(ALLOWED_REQUESTS)}")
    if requested == "cpu":
        return DeviceSpec("cpu", BACKEND_FOR_DEVICE["cpu"])
    available = available_devices()
    if requested == "auto":
        chosen = available[0]
    elif requested in available:
        chosen = requested
    else:
        raise ValueError(f"device {requested!r} is not available here; available: {available}")
    return DeviceSpec(chosen, BACKEND_FOR_DEVICE[chosen])
