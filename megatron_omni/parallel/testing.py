"""Run a function on N local processes with real torch.distributed, for multi-rank unit tests.

In the spirit of OLMo-core's ``run_distributed_test``: spawn ``world_size`` processes with torchrun's
environment, optionally bring up megatron's parallel groups, call ``fn`` and bring every rank's return
value back in rank order.  A failure on any rank is re-raised in the caller with that rank's traceback;
a hang is killed after ``timeout_s``.

The ranks are forked from a ``forkserver`` that imported torch and megatron-core once (a spawned rank pays
~3.5 s of CPU for those imports; four ranks on two cores, ~10 s a launch).  Each rank then takes the caller's
environment, working directory and ``sys.path`` as they are at the launch; only what torch and megatron-core read
while being imported comes from the environment of the first launch, when the server started.  A case inside a
launch still costs a fraction of a launch: let ``fn`` loop over many cases and return a dict of results.
"""
from __future__ import annotations

import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

from megatron_omni.parallel.state import free_port

DEVICE_FOR_BACKEND = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
_PRELOAD = ("torch", "megatron.core", "megatron_omni.parallel.state")
_POLL_S = 0.2
_EXIT_GRACE_S = 10.0  # for a finished rank to tear down its process groups and exit


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the ``__cause__`` of the re-raised exception."""


def _context() -> Any:
    """Forked from a server that imported torch and megatron-core once (~3.5 s of CPU per child otherwise)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _worker(rank: int, world_size: int, port: int, backend: str, parallel: Optional[dict],
            launcher: tuple, payload: bytes, results: Any) -> None:
    """Child entry point: the launcher's environment, cwd and sys.path (a forked child has the fork server's) →
    torchrun env → optional init_parallel → fn → (rank, ok, pickled result)."""
    environ, cwd, path = launcher
    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
    sys.path[:] = path
    try:
        import torch

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        if parallel is None:
            value = fn(*args, **kwargs)
        else:
            from megatron_omni.parallel.state import destroy_parallel, init_parallel

            state = init_parallel(**parallel, device=DEVICE_FOR_BACKEND[backend])
            try:
                value = fn(state, *args, **kwargs)
            finally:
                destroy_parallel()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit included
        text = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)  # some exception classes pickle but cannot be rebuilt
        except Exception:
            blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        results.put((rank, False, (blob, text)))


def _reraise(rank: int, world_size: int, blob: bytes, text: str) -> None:
    raise pickle.loads(blob) from RemoteTraceback(f"\n--- traceback of rank {rank} of {world_size} ---\n{text}")


def _collect(procs: list, results: Any, fn_name: str, timeout_s: float) -> dict[int, Any]:
    """Wait for one message per rank; raise on the first failure, a dead rank, or the deadline."""
    world_size = len(procs)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < world_size:
        try:
            rank, ok, data = results.get(timeout=_POLL_S)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive()]
            if dead:
                time.sleep(_POLL_S)  # let a message that raced the exit arrive
                if results.empty():
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RuntimeError(f"{fn_name}: rank(s) {dead} exited without a result, exit codes {codes}")
            if time.monotonic() > deadline:
                pending = [r for r in range(world_size) if r not in values]
                raise TimeoutError(
                    f"{fn_name} did not finish within timeout_s={timeout_s}: ranks {pending} still running "
                    f"(finished: {sorted(values)}); killed all ranks"
                ) from None
            continue
        if not ok:
            _reraise(rank, world_size, *data)
        values[rank] = pickle.loads(data)
    return values


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    backend: str = "gloo",
    parallel: Optional[dict] = None,
    timeout_s: float = 300.0,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return their results in rank order.

    ``fn`` must be a module-level function (it is pickled into the children), its return value
    picklable.  With ``parallel`` (keyword arguments of ``init_parallel``, e.g. ``{"tp": 2}``) every rank
    first calls ``init_parallel`` on the device that ``backend`` implies (gloo → cpu, nccl → cuda,
    hccl → npu) and ``fn`` receives the ``ParallelState`` as its first argument; the groups are torn down
    afterwards.  Children run with one intra-op thread; with gloo they see no GPU, so the CPU path is what
    is tested on every machine.
    """
    if backend not in DEVICE_FOR_BACKEND:
        raise ValueError(f"backend {backend!r} is not one of {list(DEVICE_FOR_BACKEND)}")
    if parallel is not None and "device" in parallel:
        raise ValueError(f"parallel={parallel} must not set 'device': it follows backend={backend!r}")
    fn_name = getattr(fn, "__qualname__", repr(fn))
    try:
        payload = pickle.dumps((fn, args, kwargs or {}))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"run_distributed needs a module-level fn and picklable args; {fn_name}: {exc}") from exc

    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else {})}
    launcher = ({**os.environ, **child_env}, os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, backend, parallel, launcher, payload, results),
                    daemon=False)  # dist_checkpointing save starts a helper process
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    grace_s = _EXIT_GRACE_S
    try:
        values = _collect(procs, results, fn_name, timeout_s)
    except BaseException:
        grace_s = 0.0  # the other ranks may be blocked in a collective with the failed one
        raise
    finally:
        for proc in procs:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [values[rank] for rank in range(world_size)]
