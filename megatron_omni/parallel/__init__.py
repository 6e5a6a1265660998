"""Device choice, process groups and the CPU compatibility layer for megatron-core.

``init_parallel`` is the entry point; model code receives the returned ``ParallelState`` and takes its
process groups from it.  Multi-rank tests use ``megatron_omni.parallel.testing.run_distributed``.
"""
from megatron_omni.parallel.cpu_compat import apply_cpu_compat, cuda_factories_on_cpu
from megatron_omni.parallel.device import DeviceSpec, select_device
from megatron_omni.parallel.state import ParallelState, destroy_parallel, init_parallel

__all__ = [
    "DeviceSpec",
    "ParallelState",
    "apply_cpu_compat",
    "cuda_factories_on_cpu",
    "destroy_parallel",
    "init_parallel",
    "select_device",
]
