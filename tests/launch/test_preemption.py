"""SIGUSR1 / SIGTERM to a `megatron-omni train` process (no launcher): the run finishes the step in flight,
checkpoints it, exits with EXIT_PREEMPTED, and `--resume` continues it to the same metrics, bit for bit, as an
uninterrupted run (megatron_omni/trainer/preemption.py).  With SLURM: tests/launch/test_slurm.py."""
import signal
import subprocess

import pytest

from megatron_omni.trainer.preemption import EXIT_PREEMPTED
from tests.launch.runs import REPO, cli, env, latest_checkpoint, metrics, wait_for_steps

pytestmark = pytest.mark.slow
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run, started at once and waited for on first use (it runs beside the first preempted run)."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    proc, done = _start(run_dir), []

    def result():
        if not done:
            rc, out = _finish(proc)
            assert rc == 0, out[-3000:]
            done.append(metrics(run_dir))
        return done[0]

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_checkpoints_at_the_step_boundary_and_resume_is_bit_exact(tmp_path, uninterrupted, sig):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    wait_for_steps(run_dir, 1, alive=lambda: proc.poll() is None)
    proc.send_signal(sig)
    rc, out = _finish(proc, timeout_s=120)
    assert rc == EXIT_PREEMPTED, out[-3000:]
    logged = metrics(run_dir)
    # save_every=0: the one checkpoint is the preemption's, of the last step logged (it ran to its end)
    assert 1 <= len(logged) < STEPS and latest_checkpoint(run_dir) == len(logged) - 1
    assert f"stopped on {sig.name} after step {len(logged) - 1}" in out

    rc, out = _finish(_start(run_dir, "--resume"))
    assert rc == 0, out[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == list(range(STEPS))
    assert metrics(run_dir) == uninterrupted()  # rewards, losses, ratios, grad norms: bit for bit
