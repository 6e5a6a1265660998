"""Run real megatron-core 0.19.2 on a machine without CUDA (CPU + gloo), for tests and small demos.

megatron-core calls CUDA-only torch APIs unconditionally; on a CPU build of torch each of them fails with
``AssertionError: Torch not compiled with CUDA enabled``.  Two pieces get past them, both used only when
no CUDA device exists (on a GPU they change nothing):

* ``apply_cpu_compat()`` points a handful of ``torch.cuda`` functions at their CPU twins, process-wide.
  Each is cheap and only ever reached by code that assumed a GPU.
* ``cuda_factories_on_cpu()`` is a scoped ``TorchFunctionMode`` for the places that hard-code the string
  ``"cuda"`` (pipeline schedules, the optimizer wrappers).  It is a context manager rather than a global
  patch because a torch-function mode adds Python overhead to every op it sees.

Why each patch exists is written next to it, with the megatron-core call sites that need it.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def _cpu_device() -> torch.device:
    """Stands in for ``torch.cuda.current_device()``.

    Needed by ``device=torch.cuda.current_device()`` allocations: tensor_parallel/mappings.py:95,145,152,185
    (gather_output, sequence-parallel gathers), tensor_parallel/layers.py:305,1000,1041,1363,1403 (weight
    allocation), utils.py:715 (GlobalMemoryBuffer), rotary_pos_embedding.py:162,
    dist_checkpointing/strategies/state_dict_saver.py:252 (checkpoint save).
    """
    return torch.device("cpu")


def _cpu_synchronize(device: object = None) -> None:
    """Stands in for ``torch.cuda.synchronize`` (a no-op: CPU ops are synchronous)."""
    torch.cpu.synchronize()


def _cpu_current_stream(device: object = None):
    """Stands in for ``torch.cuda.current_stream``: torch's device-agnostic CPU stream."""
    return torch.cpu.current_stream()


def _cpu_rng_state(device: object = "cuda") -> torch.Tensor:
    """Stands in for ``torch.cuda.get_rng_state`` / ``torch.cuda.random.get_rng_state``."""
    return torch.default_generator.get_state()


def _cpu_manual_seed(seed: int) -> None:
    """Stands in for ``torch.cuda.manual_seed``."""
    torch.default_generator.manual_seed(int(seed))


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    """Replaces megatron's ``tensor_parallel.random._set_cuda_rng_state``.

    The original defers the write through ``torch.cuda._lazy_call``, which on a CPU build queues it
    forever: no crash, but ``fork()`` would silently never switch or restore the state.
    """
    torch.default_generator.set_state(new_state)


class _DropCpuRngChangedWarning(logging.Filter):
    """``CudaRNGStatesTracker.fork`` warns when the CPU RNG moved inside the fork.  With the CUDA RNG
    routed to the CPU generator, every random op inside a fork (e.g. weight init, dropout) moves it by
    design, so that warning carries no information here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _route_cuda_rng_to_cpu() -> None:
    """Make megatron's CUDA RNG tracker drive the CPU default generator.

    ``model_parallel_cuda_manual_seed`` (tensor_parallel/random.py:490) and ``CudaRNGStatesTracker.add``
    (random.py:303-308) call ``torch.cuda.manual_seed`` / ``torch.cuda.get_rng_state``; ``fork()`` goes
    through ``_get_cuda_rng_state`` (random.py:118, ``torch.cuda.random.get_rng_state``) and
    ``_set_cuda_rng_state``.  On CPU the random ops of a forked region (weight init of TP-split
    layers, dropout) draw from the default CPU generator, so that is the generator the tracker must
    swap: inside ``fork()`` each TP rank then draws from its own tensor-parallel seed, as on GPU.
    """
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.random.get_rng_state = _cpu_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    megatron_random._set_cuda_rng_state = _cpu_set_rng_state
    logging.getLogger(megatron_random.__name__).addFilter(_DropCpuRngChangedWarning())


def apply_cpu_compat() -> bool:
    """Patch the CUDA-only calls megatron-core makes, if this process has no CUDA device.

    Idempotent.  Returns True when the layer is in effect (applied now or earlier), False on a machine
    with CUDA, where nothing is touched.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = _cpu_device
    # torch.compile folds the real current_device() to a constant (a list of functions in its torch-function
    # handler, by identity); this twin it would trace as an op returning a non-tensor and split the graph at each
    # call (gather_output's buffer: the modulation linears at TP > 1, twice per block).  Same fold for the twin.
    from torch._dynamo.variables import torch as dynamo_torch_functions

    dynamo_torch_functions.constant_fold_functions[_cpu_device] = None
    # torch.cuda.synchronize: p2p_communication.py:263,419 (batched p2p / variable seq lengths),
    # dist_checkpointing filesystem_async.py:248 and fully_parallel.py:287,296 (checkpoint save).
    # CPU ops are synchronous, so the CPU twin is a no-op with the same signature.  Distinct function
    # objects (not torch.cpu's own): torch.compile keeps one handler per function and refuses to register
    # torch.cpu.synchronize twice ("Handler already registered"), which broke every compile on a CPU.
    torch.cuda.synchronize = _cpu_synchronize
    # torch.cuda.current_stream: distributed/param_and_grad_buffer.py:632, reached by every DDP
    # finish_grad_sync / start_grad_sync.  torch.cpu.Stream is torch's device-agnostic stand-in whose
    # wait_event / wait_stream are no-ops.  (torch.cuda.Stream / stream() / Event are only reached with
    # num_distributed_optimizer_instances > 1, so they are left alone.)
    torch.cuda.current_stream = _cpu_current_stream
    _route_cuda_rng_to_cpu()
    _APPLIED = True
    return True


def _is_cuda(device: object) -> bool:
    """True for "cuda", "cuda:1", torch.device("cuda", 0) and a bare accelerator index like 0."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites ``device=<cuda>`` keyword arguments to CPU and answers ``Tensor.type()`` with the CUDA
    spelling for CPU tensors (see ``cuda_factories_on_cpu``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return result.replace("torch.", "torch.cuda.", 1)
        return result


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """Scope in which megatron-core's hard-coded ``device="cuda"`` tensors are made on the CPU.

    Wrap, on a CPU-only machine: pipeline schedule calls (``torch.zeros(..., device="cuda")`` at
    pipeline_parallel/schedules.py:749, 1121, 2292 — every schedule, PP=1 included),
    ``get_megatron_optimizer`` (optimizer.py:690-702, 1249) and ``optimizer.step()`` (clip_grads.py:96-112,
    180, 231; optimizer.py:315).

    ``Tensor.type()`` without arguments returns e.g. ``'torch.cuda.FloatTensor'`` for a CPU float tensor
    inside the scope: megatron-core uses those strings only to test dtype while assuming CUDA
    (clip_grads.py:174 assert, distrib_optimizer.py:401/466, optimizer.py:1009/1028), and would otherwise
    raise or reject fp32 CPU parameters.  Everything else passes through unchanged.  With CUDA present
    this is a plain no-op context.
    """
    if torch.cuda.is_available():
        yield
        return
    with _CudaFactoriesOnCpu():
        yield
