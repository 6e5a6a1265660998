"""Bring up torch.distributed and megatron-core's model-parallel groups, and hand them out as one object.

``init_parallel`` is the only place that reads the launcher's environment and megatron's global
``parallel_state``; everything downstream receives the frozen ``ParallelState`` and takes its process
groups from there (model math never calls ``parallel_state.get_*_group()`` itself).

Rank layout is megatron's default order ``tp-cp-ep-dp-pp``: TP ranks are adjacent, PP is outermost.
"""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_omni.parallel.cpu_compat import apply_cpu_compat
from megatron_omni.parallel.device import DeviceSpec, select_device

from megatron_omni.parallel.usp import ContextParallelGroups, new_context_parallel_groups

if TYPE_CHECKING:  # megatron-core is imported lazily: it takes seconds
    from megatron.core.process_groups_config import ProcessGroupCollection

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_CREATED_DEFAULT_GROUP = False


@dataclass(frozen=True)
class ParallelState:
    """Where this rank sits in the (tp, cp, dp, pp) grid and the groups it talks through.

    ``dp`` excludes CP (megatron's ``get_data_parallel_group()``); ``pg_collection`` is megatron-core's
    ``ProcessGroupCollection`` for APIs that take one (DDP, optimizer, schedules, GPTModel);
    ``cp_groups`` splits the CP group into ulysses x ring for USP attention.
    """

    device: DeviceSpec
    torch_device: torch.device
    world_size: int
    rank: int
    local_rank: int
    tp: int
    cp: int
    pp: int
    dp: int
    vpp: Optional[int]
    tp_rank: int
    cp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pg_collection: ProcessGroupCollection
    cp_groups: ContextParallelGroups
    ulysses: int = 1

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now, drawn below Linux's ephemeral range (32768 on):
    the caller binds it seconds later, and in between any outgoing connection (gloo's, another run's) may be handed
    an ephemeral port — one bind(0) returned (EADDRINUSE seen when two suites ran at once)."""
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_env() -> tuple[int, int, int, str]:
    """(rank, world_size, local_rank, init_method) from torchrun's variables, or a 1-process default."""
    present = [name for name in TORCHRUN_ENV if name in os.environ]
    if not present:
        return 0, 1, 0, f"tcp://127.0.0.1:{free_port()}"
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            f"torchrun environment is incomplete: {present} are set but {missing} are not; "
            f"set all of {list(TORCHRUN_ENV)} or none"
        )
    env = os.environ
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), "env://"


def _check_sizes(world_size: int, tp: int, cp: int, pp: int, vpp: Optional[int], ulysses: int = 1) -> None:
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("ulysses", ulysses)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if vpp is not None and (not isinstance(vpp, int) or vpp < 1):
        raise ValueError(f"vpp must be None or a positive int, got {vpp!r}")
    if cp % ulysses:
        raise ValueError(f"ulysses={ulysses} does not divide cp={cp}; expected a divisor (ring = cp / ulysses)")
    if world_size % (tp * cp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp}"
        )


def _bind_device(spec: DeviceSpec, local_rank: int) -> None:
    """Make ``local_rank``'s accelerator current (NCCL/HCCL use it); on CPU install the compat layer."""
    if spec.type == "cuda":
        torch.cuda.set_device(local_rank)
    elif spec.type == "npu":
        torch.npu.set_device(local_rank)
    elif torch.cuda.is_available():
        raise ValueError(
            "device 'cpu' was requested in a process that sees CUDA: megatron-core 0.19.2 would still "
            "allocate on torch.cuda.current_device(). Use device='auto', or run on the CPU in a process "
            "whose GPUs are hidden (CUDA_VISIBLE_DEVICES='', as run_distributed(backend='gloo') does)"
        )
    else:
        apply_cpu_compat()


def _init_default_group(backend: str, rank: int, world_size: int, init_method: str, timeout_s: float) -> None:
    global _CREATED_DEFAULT_GROUP
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    _CREATED_DEFAULT_GROUP = True


def init_parallel(
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    device: str = "auto",
    timeout_s: float = 600.0,
    ulysses: int = 1,
) -> ParallelState:
    """Initialise torch.distributed (unless already up) and megatron's parallel groups; seed all RNGs.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as set by torchrun; with none of them
    set it runs as a single process.  ``seed`` feeds ``torch.manual_seed`` and megatron's
    ``model_parallel_cuda_manual_seed`` (the TP-rank-specific stream used inside
    ``get_cuda_rng_tracker().fork()``).  ``timeout_s`` bounds every collective.  ``ulysses`` is the
    Ulysses degree inside the CP group (ring degree = cp / ulysses).
    """
    spec = select_device(device)
    if dist.is_initialized():
        rank, world_size, init_method = dist.get_rank(), dist.get_world_size(), None
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    else:
        rank, world_size, local_rank, init_method = _launch_env()
    _check_sizes(world_size, tp, cp, pp, vpp, ulysses)

    # Imported only now: megatron-core takes seconds to import, the checks above do not need it.
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron model parallel is already initialised; call destroy_parallel() first")
    _bind_device(spec, local_rank)
    if init_method is not None:
        _init_default_group(spec.backend, rank, world_size, init_method, timeout_s)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp,
        distributed_timeout_minutes=max(1, round(timeout_s / 60)),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return _describe(spec, local_rank, tp, cp, pp, vpp, ulysses)


def _describe(spec: DeviceSpec, local_rank: int, tp: int, cp: int, pp: int, vpp: Optional[int],
              ulysses: int) -> ParallelState:
    """Snapshot megatron's freshly built groups into a ParallelState."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    world_size = dist.get_world_size()
    return ParallelState(
        device=spec,
        torch_device=spec.torch_device(local_rank),
        world_size=world_size,
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=tp,
        cp=cp,
        pp=pp,
        dp=world_size // (tp * cp * pp),
        vpp=vpp,
        tp_rank=dist.get_rank(pgs.tp),
        cp_rank=dist.get_rank(pgs.cp),
        pp_rank=dist.get_rank(pgs.pp),
        dp_rank=dist.get_rank(pgs.dp),
        tp_group=pgs.tp,
        cp_group=pgs.cp,
        pp_group=pgs.pp,
        dp_group=pgs.dp,
        pg_collection=pgs,
        cp_groups=new_context_parallel_groups(pgs.cp, ulysses),
        ulysses=ulysses,
    )


_SINGLE_RANK_GROUPS: dict[int, dist.ProcessGroup] = {}  # id(tp_group) -> this rank's group of one


def single_rank_group(state: ParallelState) -> dist.ProcessGroup:
    """A process group of this rank alone, for a model that runs whole on every rank (the in-process rollout
    engine beside a TP-sharded policy).  At tp == 1 the TP group is one; else a collective: every rank calls it
    (``new_subgroups``), once per layout."""
    if state.tp == 1:
        return state.tp_group
    key = id(state.tp_group)
    if key not in _SINGLE_RANK_GROUPS:
        _SINGLE_RANK_GROUPS[key], _ = dist.new_subgroups(group_size=1)
    return _SINGLE_RANK_GROUPS[key]


def destroy_parallel(keep_default_group: bool = False) -> None:
    """Tear down megatron's groups, and the default process group if ``init_parallel`` created it.

    ``keep_default_group=True`` keeps torch.distributed up so that the next ``init_parallel`` can lay
    out a different (tp, cp, pp) on the same ranks, e.g. to test several layouts in one launch.
    Re-creating the default group instead is unsafe on a fixed MASTER_PORT: a rank may still reach the
    old rendezvous store and read stale addresses.
    """
    global _CREATED_DEFAULT_GROUP
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _SINGLE_RANK_GROUPS.clear()
    if keep_default_group:
        return
    if _CREATED_DEFAULT_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _CREATED_DEFAULT_GROUP = False
