"""`sbatch launch/slurm.sbatch train ...` on a real SLURM cluster on localhost (tests/launch/slurm_cluster.py: munged,
slurmctld, two slurmd): 2 tasks on nodes n1 and n2, one torchrun each, meet at a c10d rendezvous and train the
digits recipe as one run of 2 data-parallel ranks.  Preemption: the batch shell's USR1 (what `--signal=B:USR1@N`
sends N s before the time limit) makes the ranks checkpoint after their step; the job requeues itself and the
requeued run resumes (`--resume`) to the uninterrupted job's metrics, bit for bit."""
import re

import pytest

from megatron_omni.parallel.state import free_port
from tests.launch.runs import REPO, env, latest_checkpoint, metrics, rendezvous, train_args, wait_for_steps
from tests.launch.slurm_cluster import SlurmCluster, ensure_installed

pytestmark = pytest.mark.slow
STEPS = 8  # ~0.5 s each at 2 ranks: the signal, sent once step 0 is logged, lands before the last


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_installed()
    if reason:
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


@pytest.fixture(scope="module")
def completed(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    job, out = _sbatch(cluster, run_dir)
    return cluster.wait_job(job, timeout_s=400), run_dir, out.read_text()


def test_sbatch_runs_two_tasks_on_two_nodes_to_completion(completed):
    info, run_dir, log = completed
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), log[-3000:]
    assert rendezvous(log) == ({"0", "1"}, {"2"}), log[-3000:]  # one world: both agents, ranks 0 and 1
    assert [m["step"] for m in metrics(run_dir)] == list(range(STEPS))
    assert latest_checkpoint(run_dir) == STEPS - 1


# what --signal=B:USR1@N (or B:TERM@N) sends to the batch shell N s before the time limit.  A TERM to every process
# of the job (SLURM's preemption, `scancel --full`) reaches srun too, which then cancels the step within ~1 s, before
# any rank finishes its step (measured): that run resumes from its last periodic checkpoint instead (launch/README.md).
@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_preempted_job_requeues_and_resumes_bit_exactly(cluster, completed, tmp_path, sig):
    run_dir = tmp_path / "run"
    job, out = _sbatch(cluster, run_dir)
    wait_for_steps(run_dir, 1, alive=lambda: cluster.job(job)["JobState"] in ("PENDING", "RUNNING"))
    cluster.cli("scancel", f"--signal={sig}", "--batch", job)
    info = cluster.wait_job(job, timeout_s=400)
    log = out.read_text()  # --open-mode=append: both runs of the job
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    stopped = re.findall(r"stopped on SIGTERM after step (\d+)", log)
    assert stopped and f"slurm.sbatch: SIG{sig}: requeueing job" in log, log[-3000:]
    assert re.search(r"restart 1 on n\[1-2\].* --resume", log), log[-3000:]
    assert 0 <= int(stopped[0]) < STEPS - 1
    assert metrics(run_dir) == metrics(completed[1])  # rewards, losses, ratios, grad norms: bit for bit
