"""Multi-node rendezvous without a scheduler: two torchrun agents on localhost, as two nodes would start them
(`--nnodes=2 --node-rank=0/1`, one rank each), meet at a c10d endpoint and form one gloo run of the digits recipe
(2 data-parallel ranks), which trains and finishes on both."""
import subprocess
import sys

import pytest

from megatron_omni.parallel.state import free_port
from tests.launch.runs import REPO, env, latest_checkpoint, metrics, rendezvous, train_args

pytestmark = pytest.mark.slow


def test_two_torchrun_agents_form_one_run(tmp_path):
    run_dir, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    agents = []
    for node_rank in (0, 1):
        log = open(tmp_path / f"agent{node_rank}.log", "w")
        agents.append((log, subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
             "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes",
             "-m", "megatron_omni.cli", *train_args(run_dir, steps=2)],
            env=env(LOGLEVEL="INFO"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)))
    try:
        codes = [p.wait(timeout=300) for _, p in agents]
    finally:
        for log, p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = [open(log.name).read() for log, _ in agents]
    assert codes == [0, 0], "\n".join(f"--- agent {i}: exit {c}\n{text[-2000:]}" for i, (c, text) in
                                      enumerate(zip(codes, logs)))
    # one world of 2, one rank per agent (c10d numbers the agents in the order they join, not by --node-rank)
    ranks, sizes = zip(*(rendezvous(text) for text in logs))
    assert sorted(map(sorted, ranks)) == [["0"], ["1"]] and sizes == ({"2"}, {"2"})
    assert [m["step"] for m in metrics(run_dir)] == [0, 1] and latest_checkpoint(run_dir) == 1
