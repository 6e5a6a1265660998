"""`sbatch launch/slurm.sbatch train ...` on a real SLURM cluster on localhost (tests/launch/slurm_cluster.py: munged,
slurmctld, two slurmd): 2 tasks on nodes n1 and n2, one torchrun each, meet at a c10d rendezvous and train the
digits recipe as one run of 2 data-parallel ranks.  Preemption: the batch shell's USR1 (what `--signal=B:USR1@N`
sends N s before the time limit) makes the ranks checkpoint after their step; the job requeues itself and the
requeued run resumes (`--resume`) to the uninterrupted job's metrics, bit for bit."""
import re
import time

import pytest

from megatron_omni.parallel.state import free_port
from tests.launch.runs import REPO, env, latest_checkpoint, metrics, rendezvous, train_args
from tests.launch.slurm_cluster import SlurmCluster, ensure_installed

pytestmark = pytest.mark.slow
# 0.2-0.5 s each at 2 ranks: the signal, sent once step 0 is logged, must land before the last.  At 8 steps it once
# came after the run's end (scancel -> slurmctld -> slurmd -> the batch shell took > 3 s on two busy cores).
STEPS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_installed()  # raises when an install here was tried and failed
    if reason:  # no SLURM and no way to install it on this machine (not root, no apt-get)
        pytest.skip(reason)
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


def _sbatch(cluster, run_dir):
    """Submit the tiny digits run on both nodes, one rank per node; returns (job id, its output file)."""
    out = run_dir.parent / f"{run_dir.name}.out"
    job = cluster.cli(
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0",
        f"--output={out}", "launch/slurm.sbatch", *train_args(run_dir, STEPS), cwd=REPO,
        env=env(NPROC_PER_NODE="1", MASTER_PORT=str(free_port()), LOGLEVEL="INFO")).strip()
    return job, out


# What --signal=B:USR1@N (or B:TERM@N) sends to the batch shell N s before the time limit.  A TERM to every process
# of the job (SLURM's preemption, `scancel --full`) reaches srun too, which then cancels the step within ~1 s, before
# any rank finishes its step (measured): that run resumes from its last periodic checkpoint instead (launch/README.md).
SIGNALS = ("USR1", "TERM")


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """The uninterrupted job and one job per preempting signal, submitted at once (the nodes take two at a time);
    each of the latter gets its signal once its step 0 is logged.  name -> (run dir, job id, output file)."""
    root = tmp_path_factory.mktemp("jobs")
    submitted = {name: (root / name, *_sbatch(cluster, root / name)) for name in ("whole", *SIGNALS)}
    waiting, deadline = set(SIGNALS), time.monotonic() + 400
    while waiting:
        for sig in sorted(waiting):
            run_dir, job, out = submitted[sig]
            if metrics(run_dir):
                cluster.cli("scancel", f"--signal={sig}", "--batch", job)
                waiting.discard(sig)
            elif cluster.job(job)["JobState"] not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
                raise AssertionError(f"job {job} ({sig}) logged no step: {cluster.job(job)['JobState']}\n"
                                     f"{out.read_text()[-3000:] if out.exists() else ''}")
        time.sleep(0.05)
    return submitted


def _finished(cluster, jobs, name):
    run_dir, job, out = jobs[name]
    return cluster.wait_job(job, timeout_s=400), run_dir, out.read_text()


def test_sbatch_runs_two_tasks_on_two_nodes_to_completion(cluster, jobs):
    info, run_dir, log = _finished(cluster, jobs, "whole")
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), log[-3000:]
    assert rendezvous(log) == ({"0", "1"}, {"2"}), log[-3000:]  # one world: both agents, ranks 0 and 1
    assert [m["step"] for m in metrics(run_dir)] == list(range(STEPS))
    assert latest_checkpoint(run_dir) == STEPS - 1


@pytest.mark.parametrize("sig", SIGNALS)
def test_preempted_job_requeues_and_resumes_bit_exactly(cluster, jobs, sig):
    info, run_dir, log = _finished(cluster, jobs, sig)  # --open-mode=append: the log of both runs of the job
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    stopped = re.findall(r"stopped on SIGTERM after step (\d+)", log)
    assert stopped and f"slurm.sbatch: SIG{sig}: requeueing job" in log, log[-3000:]
    assert re.search(r"restart 1 on n\[1-2\].* --resume", log), log[-3000:]
    assert 0 <= int(stopped[0]) < STEPS - 1
    assert metrics(run_dir) == metrics(jobs["whole"][0])  # rewards, losses, ratios, grad norms: bit for bit
