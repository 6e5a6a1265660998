"""A real SLURM cluster on localhost for the launch tests: munged, slurmctld and two slurmd (nodes n1, n2 on one host,
Debian's build has MULTIPLE_SLURMD), all children of the test process, in a scratch folder.  Measured on Debian 12's
SLURM 22.05.8: the daemons start in ~2 s; foreground (-D) children, since PID 1 reaps no daemon; cred_expire=5 makes a
requeued job start again ~7 s later (the default, 120 s).
Protocol: install (apt-get, root) → write conf → munged → slurmctld → slurmd × 2 → nodes idle → ... → cancel jobs →
stop slurmd, slurmctld, munged."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from megatron_omni.parallel.state import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
NODES = ("n1", "n2")


def ensure_installed() -> str | None:
    """None when the SLURM and munge binaries are there (installing them when root); else why they cannot be
    installed here (not root, no apt-get).  An install that ran and failed raises: where SLURM can be installed
    (CI: a root Debian machine) its tests must run, not skip."""
    if all(shutil.which(b) for b in DAEMONS):
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed and this is not root (uid {os.geteuid()}): apt-get install {' '.join(PACKAGES)}"
    if not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    out = subprocess.run(install, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # a stale or empty package index
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True)
        out = subprocess.run(install, env=env, capture_output=True, text=True)
    missing = [b for b in DAEMONS if not shutil.which(b)]
    if missing:
        raise RuntimeError(f"apt-get install {' '.join(PACKAGES)} failed (exit {out.returncode}; missing "
                           f"{missing}): {out.stderr.strip()[-400:]}")
    return None


def slurm_conf(root: Path, run: Path, host: str, ports: dict[str, int]) -> str:
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs=2 RealMemory=4000 "
                      "State=UNKNOWN" for n in NODES)
    return f"""ClusterName=ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={run}/munge.socket.2,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
JobRequeue=1
SchedulerParameters=bf_interval=1,sched_interval=2
KillWait=5
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root, self.procs = root, []
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants its socket folder 755 and every folder above it executable by all (pytest's are 700)
        self.run = Path(tempfile.mkdtemp(prefix="munge-"))
        os.chmod(self.run, 0o755)
        self.conf = root / "slurm.conf"
        ports = {"ctld": free_port(), **{n: free_port() for n in NODES}}
        self.conf.write_text(slurm_conf(root, self.run, socket.gethostname(), ports))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        run, key = self.run, self.root / "munge.key"
        subprocess.run(["mungekey", "-c", "-f", "-k", str(key)], check=True, capture_output=True)
        self._spawn("munged", ["munged", "-F", f"--key-file={key}", f"--socket={run}/munge.socket.2",
                               f"--pid-file={run}/munged.pid", f"--log-file={self.root}/log/munged.log",
                               f"--seed-file={run}/munged.seed"])
        self._wait_for(lambda: (run / "munge.socket.2").exists(), "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd {node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait_for(lambda: self.node_states() == ["idle"] * len(NODES), "both nodes idle in sinfo")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name.replace(' ', '-')}.stdout", "wb")
        self.procs.append((name, subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)))

    def _wait_for(self, ready, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM on localhost: no {what} after {timeout_s} s (exited: {dead}); logs in "
                                   f"{self.root / 'log'}:\n{self.logs()}")
            time.sleep(0.2)

    def cli(self, *argv: str, check: bool = True, env: dict[str, str] | None = None, **kw) -> str:
        out = subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def node_states(self) -> list[str]:
        return self.cli("sinfo", "-h", "-N", "-o", "%t", check=False).split()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        fields = self.cli("scontrol", "show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait_job(self, job_id: str, timeout_s: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                               "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout_s} s")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted((self.root / "log").iterdir()))

    def stop(self) -> None:
        """Cancel what is still queued or running (slurmstepd and its ranks outlive slurmd), then the daemons."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self.procs):
            self.cli("scancel", "--user=root", check=False, timeout=30)
            deadline = time.monotonic() + 30
            while self.cli("squeue", "-h", check=False, timeout=30).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name, p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = []
        shutil.rmtree(self.run, ignore_errors=True)
