"""SIGUSR1 / SIGTERM to a `megatron-omni train` process (no launcher): the run finishes the step in flight,
checkpoints it, exits with EXIT_PREEMPTED, and `--resume` continues it to the same metrics, bit for bit, as an
uninterrupted run (megatron_omni/trainer/preemption.py).  With SLURM: tests/launch/test_slurm.py."""
import os
import re
import signal
import subprocess

import pytest
import torch

from megatron_omni.parallel.testing import run_distributed
from megatron_omni.trainer.preemption import EXIT_PREEMPTED, StopSignals
from tests.launch.runs import REPO, cli, env, metrics, wait_for_steps

STEPS = 10  # ~0.3 s each: the signal, sent once step 0 is logged, lands well before the last


def _start(run_dir, *extra):
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen(cli(run_dir, STEPS) + list(extra), env=env(), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def _finish(proc, timeout_s=300) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.log.close()
    return rc, open(proc.log.name).read()


SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def _one_rank_signalled(state):
    signals = StopSignals(torch.device("cpu"))
    before = signals.requested()
    if state.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next bytecode: only a flag is set
    after = signals.requested()
    signals.close()
    return before, after, signals.signame, signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step():
    assert run_distributed(_one_rank_signalled, 2, parallel={}, timeout_s=120) == [
        (False, True, "a signal on another rank", True), (False, True, "SIGUSR1", True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run and one run per signal, at once; each of the latter gets its signal once its step 0 is
    logged, then is resumed with --resume (both at once).  name -> (run dir, [(exit code, output) of each process])."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: root / name for name in ("whole", *(s.name for s in SIGNALS))}
    procs, resumed = {name: _start(run_dir) for name, run_dir in dirs.items()}, {}
    try:
        for sig in SIGNALS:
            proc = procs[sig.name]
            wait_for_steps(dirs[sig.name], 1, alive=lambda: proc.poll() is None)
            proc.send_signal(sig)
        done = {name: [_finish(proc)] for name, proc in procs.items()}
        resumed.update({sig.name: _start(dirs[sig.name], "--resume") for sig in SIGNALS})
        for name, proc in resumed.items():
            done[name].append(_finish(proc))
    finally:
        for proc in [*procs.values(), *resumed.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: (dirs[name], done[name]) for name in dirs}


@pytest.mark.slow
def test_uninterrupted_run_completes(runs):
    run_dir, [(rc, out)] = runs["whole"]
    assert rc == 0, out[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == list(range(STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_signal_checkpoints_at_the_step_boundary_and_resume_is_bit_exact(runs, sig):
    run_dir, [(rc, out), (resumed_rc, resumed_out)] = runs[sig.name]
    assert rc == EXIT_PREEMPTED, out[-3000:]
    stopped = re.findall(rf"stopped on {sig.name} after step (\d+)", out)
    # save_every=0: the one checkpoint is the preemption's, of the step in flight (it ran to its end)
    assert stopped and 0 <= int(stopped[0]) < STEPS - 1, out[-3000:]
    assert f"step {int(stopped[0]) + 2}/{STEPS}" not in out  # no step after it began
    assert resumed_rc == 0, resumed_out[-3000:]
    assert f"step {int(stopped[0]) + 1}/{STEPS}" not in resumed_out  # it resumed after the checkpointed step
    assert metrics(run_dir) == metrics(runs["whole"][0])  # rewards, losses, ratios, grad norms: bit for bit
