"""What waits in host memory between a step's phases, and its way back to the device.

* Trajectories (``rollout.trajectories_on=host``): a step's trajectories move to host memory as the rollout
  returns them (pinned when the trainer's device is a GPU, so the copies back are asynchronous); training copies
  each micro-batch to the device only when megatron's schedule reaches it (``OnDevice``), so the device holds one
  micro-batch of them at a time instead of every sample's latents at every step.
* The pipeline task's text encoder and VAE (``data.offload_encoders``): to host memory while the policy trains,
  back on the device at the next encode / decode (``PartsOffload``).
On a CPU run host and device are one memory: the trajectories are not copied and the parts do not move.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch


def to_host(trajectory, pin: bool):
    """The trajectory with its tensors in host memory (pinned with ``pin``); the request is left as it is."""
    def host(t):
        if t is None or t.device.type == "cpu":
            return t
        t = t.cpu()
        return t.pin_memory() if pin else t
    return dataclasses.replace(trajectory, latents=host(trajectory.latents), log_probs=host(trajectory.log_probs),
                               trained=host(trajectory.trained), uncond_velocity=host(trajectory.uncond_velocity))


def move(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (dataclass fields, dicts, lists, tuples, nested) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(v, device) for v in obj)
    return obj


class OnDevice(Sequence):
    """Micro-batches copied to ``device`` one at a time, as an iterator over them reaches each (every pass of
    megatron's schedule iterates anew: one iterator per model chunk under interleaved PP)."""

    def __init__(self, microbatches: Sequence, device: torch.device):
        self.microbatches, self.device = microbatches, device

    def __len__(self) -> int:
        return len(self.microbatches)

    def __getitem__(self, i):
        return move(self.microbatches[i], self.device)

    def __iter__(self) -> Iterator:
        return (move(mb, self.device) for mb in self.microbatches)


class PartsOffload:
    """A task's device-resident parts (objects holding ``nn.Module`` attributes, or lists of them, that they run
    on their ``device``: a family's text encoder and VAE) moved to host memory by ``offload()`` and back by
    ``onload()``; ``wrap(fn)`` onloads before ``fn`` runs.  Protocol: offload when training begins → onload at the
    next encode / decode.  Nothing moves when the parts' device is the CPU."""

    def __init__(self, parts: Sequence[Any], device: torch.device | str):
        self.parts, self.device = list(parts), torch.device(device)
        self.on_device = True

    @property
    def active(self) -> bool:
        return self.device.type != "cpu"

    def _modules(self) -> list[torch.nn.Module]:
        """Every module a part holds, as an attribute or in a list attribute (SD3's three text encoders)."""
        held = [v for part in self.parts for value in vars(part).values()
                for v in (value if isinstance(value, (list, tuple)) else [value])]
        return [m for m in held if isinstance(m, torch.nn.Module)]

    def offload(self) -> None:
        if self.active and self.on_device:
            for module in self._modules():
                module.to("cpu")
            self.on_device = False

    def onload(self) -> None:
        if self.active and not self.on_device:
            for module in self._modules():
                module.to(self.device)
            self.on_device = True

    def wrap(self, fn: Callable) -> Callable:
        def onloaded(*args, **kwargs):
            self.onload()
            return fn(*args, **kwargs)
        return onloaded
