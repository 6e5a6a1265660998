"""One rollout batch's denoiser forward replayed as a CUDA graph (``rollout.cuda_graphs``).

Within a batch every denoising step calls the model with the same shapes, dtypes and flags -- only the values of
the latents, the timestep and its modulation change -- so its later steps can replay one captured forward instead
of launching its ~2,000 kernels one by one from the host: the launch gaps (cuDNN attention's host path, dynamo's
guard checks, the custom ops' dispatch) leave the GPU's timeline.  The protocol, per forward layout of a batch:
call 1 runs as it is (it compiles, it warms cuBLAS / cuDNN up) → call 2 captures → every call copies its inputs
into the captured ones and replays.  A graph lives for one batch: the next batch brings new weights or shapes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

_TENSOR = "tensor"


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """The structure of ``obj`` (tensors replaced by a marker, appended to ``leaves`` in order), comparable with
    ``==``: nested tuples / lists / dicts / dataclasses (a family's per-step conditioning) and plain values."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (_TENSOR, tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(_flatten(o, leaves) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, _flatten(v, leaves)) for k, v in obj.items()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple((f.name, _flatten(getattr(obj, f.name), leaves)) for f in dataclasses.fields(obj)))
    return obj


def _rebuild(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced, in ``_flatten``'s order, by ``leaves`` (consumed)."""
    if isinstance(obj, torch.Tensor):
        return leaves.pop(0)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(o, leaves) for o in obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, leaves) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        values = {f.name: _rebuild(getattr(obj, f.name), leaves) for f in fields}  # all: _flatten's order
        return dataclasses.replace(obj, **{f.name: values[f.name] for f in fields if f.init})
    return obj


class ReplayedForward:
    """``forward(*args, **kwargs) -> Tensor`` run as it is at its first call, captured into a CUDA graph at its
    second, replayed from then on with each call's tensors copied into the captured inputs (one ``_foreach_copy_``).
    Every call must have the first's structure: the same non-tensor values and tensor shapes, dtypes and devices
    (else ValueError).  The returned tensor is the call's own (a copy of the graph's output buffer).  ``pool``: a
    memory pool shared with the batch's other layouts' graphs (replayed in their capture order, one at a time);
    ``stream``: the side stream to capture on (an engine keeps one, so that its cuBLAS / cuDNN workspaces exist
    after the first batch)."""

    def __init__(self, forward: Callable[..., torch.Tensor], pool=None, stream: torch.cuda.Stream | None = None):
        self._forward, self._pool, self._stream = forward, pool, stream
        self._calls = 0
        self._spec: Any = None
        self._inputs: list[torch.Tensor] = []  # the captured forward reads these
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        leaves: list[torch.Tensor] = []
        spec = _flatten((args, kwargs), leaves)
        self._calls += 1
        if self._calls == 1:
            self._spec = spec
            return self._forward(*args, **kwargs)
        if spec != self._spec:
            raise ValueError(f"a CUDA-graphed rollout forward was called with inputs of another structure at call "
                             f"{self._calls}: {spec!r}; expected its first call's {self._spec!r}")
        if self._graph is None:
            self._capture(args, kwargs, leaves)
        else:
            torch._foreach_copy_(self._inputs, leaves)
        self._graph.replay()
        return self._out.clone()

    def _capture(self, args: tuple, kwargs: dict, leaves: list[torch.Tensor]) -> None:
        # the captured inputs: copies that keep each tensor's strides where it is dense (what the compiled graphs
        # were specialised on at the first call)
        self._inputs = [torch.empty_like(t).copy_(t) for t in leaves]
        args, kwargs = _rebuild((args, kwargs), list(self._inputs))
        graph = torch.cuda.CUDAGraph()
        # a side stream, as capture requires; it starts after the work queued so far, and the replays, on the
        # caller's stream, follow the capture (no device synchronisation: the GPU keeps the queue it has)
        stream, caller = self._stream or torch.cuda.Stream(), torch.cuda.current_stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = self._forward(*args, **kwargs)
            finally:
                graph.capture_end()
        caller.wait_stream(stream)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"a CUDA-graphed rollout forward returned {type(out).__name__}; expected a tensor")
        self._graph, self._out = graph, out

