"""Preemption: SIGUSR1 or SIGTERM asks the run to stop at the next step boundary.  Protocol: signal → finish the
current RL step → every rank agrees → checkpoint → raise ``Preempted`` → ``megatron-omni train`` exits with
``EXIT_PREEMPTED``; the launcher requeues and the next run continues with ``--resume`` (bit-exact, see
megatron_omni/trainer/checkpoint.py).

SLURM sends SIGUSR1 ``N`` seconds before the time limit (``#SBATCH --signal=...USR1@N``) and SIGTERM on
preemption or ``scancel``; launch/slurm.sbatch relays either to the ranks as SIGTERM through torchrun (whose
agent forwards SIGTERM and waits ``--shutdown-timeout`` seconds for the ranks to exit).
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

# sysexits.h EX_TEMPFAIL, "temporary failure, try again": the run stopped early on request and left a checkpoint to
# resume from; a cluster may also list it in slurm.conf's RequeueExit.
EXIT_PREEMPTED = 75

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(Exception):
    """The run stopped on a signal after checkpointing ``step``."""

    def __init__(self, step: int, signame: str):
        super().__init__(f"stopped on {signame} after step {step} (checkpointed); rerun with --resume to continue")
        self.step, self.signame = step, signame


class StopSignals:
    """Records SIGUSR1 / SIGTERM instead of dying of them, from construction until ``close()``.  The handler only
    sets a flag: the step in flight finishes, and ``requested()`` at its boundary decides, on every rank alike."""

    def __init__(self, device: torch.device):
        self.device, self.signame, self._previous = device, None, {}
        if threading.current_thread() is threading.main_thread():  # Python installs handlers only there
            self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}

    def _record(self, signum: int, _frame) -> None:
        self.signame = self.signame or signal.Signals(signum).name  # a second signal (the agent's relay) is the same

    def requested(self) -> bool:
        """Whether any rank got a signal: a collective (a MAX of one flag), since the signal reaches the ranks at
        slightly different moments and all of them must stop after the same step.  Call it on every rank."""
        flag = torch.tensor([float(self.signame is not None)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signame is None:
            self.signame = "a signal on another rank"
        return bool(flag.item())

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
