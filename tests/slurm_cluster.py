"""A single-node SLURM cluster for the tests: munged, slurmctld and slurmd from Debian's packages
(slurmctld, slurmd, slurm-client, munge), each configured in a directory of its own with its own
key, socket and ports (nothing under /etc is read or written), started for a test module and
stopped after it. The node declares 4 CPUs whatever the machine has, so `srun -n 4` runs on 2.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

from ranks import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "scancel")
START_TIMEOUT_S = 60

CONFIG = """\
ClusterName=ringcomm
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
MailProg=/bin/true
# No cgroups: a container may not delegate them.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# The node's CPUs as declared here, not as slurmd counts them.
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def find(name: str) -> str | None:
    """A SLURM or munge program: on PATH, or where Debian puts the daemons."""
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "slurmd starts tasks as their user: needs root"
    missing = [name for name in DAEMONS + CLIENTS if find(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: apt-get install slurmctld slurmd slurm-client munge"
        )
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return f"this host's name {host} does not resolve: SLURM's node name is rank 0's address"
    return None


class SlurmCluster:
    """One node named as this host, with `cpus` CPUs. env() is what srun, sinfo and the tasks
    need to reach it (SLURM_CONF)."""

    def __init__(self, directory, cpus: int = 4):
        self.dir = str(directory)
        self.host = socket.gethostname()
        self.cpus = cpus
        self.procs = []

    def env(self) -> dict:
        return dict(os.environ, SLURM_CONF=os.path.join(self.dir, "slurm.conf"))

    def start(self) -> None:
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        key = os.path.join(self.dir, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        open(os.path.join(self.dir, "plugstack.conf"), "w").close()
        with open(os.path.join(self.dir, "slurm.conf"), "w") as f:
            f.write(
                CONFIG.format(
                    host=self.host,
                    dir=self.dir,
                    cpus=self.cpus,
                    ctld_port=free_port(),
                    slurmd_port=free_port(),
                )
            )
        conf = os.path.join(self.dir, "slurm.conf")
        # --force: munged otherwise refuses a socket directory under a world-writable /tmp.
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.dir}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={self.dir}/munged.pid",
                f"--log-file={self.dir}/munged.log",
                f"--seed-file={self.dir}/munged.seed",
            ],
        )
        self._wait(lambda: os.path.exists(f"{self.dir}/munge.socket"), "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
        self._spawn("slurmd", ["slurmd", "-D", "-f", conf, "-N", self.host])
        self._wait(self._idle, "the node to be idle in sinfo")

    def run(self, args, timeout: float) -> subprocess.CompletedProcess:
        """A SLURM client command (srun ...) against this cluster, its output captured."""
        return subprocess.run(
            [find(args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
        )

    def logs(self) -> str:
        """The daemons' logs, for a failed test's message."""
        parts = []
        for name in DAEMONS:
            path = os.path.join(self.dir, f"{name}.out")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    parts.append(f"== {name}\n{f.read()[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        if len(self.procs) > 1 and self.procs[1].poll() is None:  # slurmctld: cancel what is left
            subprocess.run(
                [find("scancel"), f"--user={os.getuid()}"],
                env=self.env(),
                timeout=30,
                capture_output=True,
            )
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, name: str, argv) -> None:
        with open(os.path.join(self.dir, f"{name}.out"), "w") as out:
            self.procs.append(
                subprocess.Popen(
                    [find(argv[0]), *argv[1:]],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                    stdin=subprocess.DEVNULL,
                )
            )

    def _idle(self) -> bool:
        out = subprocess.run(
            [find("sinfo"), "--noheader", "--format=%t"],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=30,
        )
        return out.stdout.strip() == "idle"

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [argv for argv, p in zip(DAEMONS, self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SLURM did not start ({what}; exited: {dead}):\n{self.logs()}")
            time.sleep(0.2)
