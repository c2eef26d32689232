"""Which rank this process is, and where the ranks meet: read from whatever launched it.

    launch = ringcomm.launch.discover()     # rank, world_size, local_rank, master_addr, master_port
    ringcomm.launch.init_process_group("ringcomm")   # dist.init_process_group under any launcher

Launchers nest (torchrun inside srun, mpirun inside an sbatch allocation), and the innermost one
describes the process. The first of these that is present wins (docs/launching.md):

1. arguments: rank= and world_size= given;
2. torchrun / torchelastic, or the same env:// variables set by hand or by a Kubernetes
   PyTorchJob: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
3. SLURM, for a task of an srun step (SLURM_STEP_ID a step's number; a batch script has none):
   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; rank 0's host is the first of SLURM_STEP_NODELIST
   (else SLURM_JOB_NODELIST), the port is derived from SLURM_JOB_ID. Where an MPI launcher's
   variables give another rank or size, that launcher runs inside the allocation (mpirun in a
   batch script, its daemons started by srun) and its variables are taken;
4. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK;
5. MPICH / Intel MPI's mpiexec (Hydra), or srun --mpi=pmi2: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID.

MASTER_ADDR and MASTER_PORT, where set, override the address and port of launchers 3 to 5. An MPI
launcher names no host for rank 0: with every rank on one host the ranks meet at 127.0.0.1, across
hosts MASTER_ADDR must be set. A partial or contradictory environment raises LaunchError naming
the variables, at once, before any rank waits for another. What was found, and from which
variables, is logged at INFO on the "ringcomm.launch" logger.

The standard library only; torch is imported where a store or a process group is made.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

logger = logging.getLogger(__name__)

# Ports derived from a job's identity fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's
# ephemeral range (32768 up), so no outgoing connection of the host holds one by chance.
PORT_BASE = 10000
PORT_SPAN = 20000


class LaunchError(ValueError):
    """The environment names no launcher, or one partly or inconsistently."""


@dataclass(frozen=True)
class Launch:
    """This process's place in its job, and where the job's ranks meet (the TCPStore that rank 0
    hosts, or torchrun's agent)."""

    launcher: str  # "arguments", "torchrun", "env", "slurm", "openmpi", "mpich"
    rank: int
    world_size: int
    local_rank: Optional[int]  # among the ranks on this host; None where the launcher says not
    local_world_size: Optional[int]
    master_addr: Optional[str]  # None only for "arguments" without MASTER_ADDR
    master_port: Optional[int]
    agent_store: bool = False  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)

    def env(self) -> dict:
        """The env:// variables of this launch (those known), as torchrun would set them."""
        values = {
            "RANK": self.rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.local_world_size,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        return {name: str(value) for name, value in values.items() if value is not None}

    def export(self) -> None:
        """Sets env() in os.environ, for torch.distributed's env:// rendezvous, the core's choice
        of a listening address (the route to MASTER_ADDR) and the processes this one starts."""
        os.environ.update(self.env())

    def tcp_store(self, timeout: timedelta = timedelta(minutes=10)):
        """The job's torch.distributed TCPStore at master_addr:master_port: rank 0 hosts it,
        unless torchrun's agent does."""
        if self.master_addr is None or self.master_port is None:
            raise LaunchError(
                "no store given and MASTER_ADDR/MASTER_PORT are not set (set them, "
                "start the ranks with a launcher, or pass store=)"
            )
        import torch.distributed as dist

        return dist.TCPStore(
            self.master_addr,
            self.master_port,
            self.world_size,
            is_master=self.rank == 0 and not self.agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )


def discover(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Launch:
    """This process's Launch: rank and world_size as given, else from the launcher that started
    it (detect()). Given both, the environment is not searched for ranks, and MASTER_ADDR and
    MASTER_PORT (if set) are where the ranks meet. Logs what it found at INFO."""
    env = os.environ if environ is None else environ
    if rank is not None and world_size is not None:
        rank = _checked_rank(int(rank), int(world_size), "rank", "world_size")
        launch = Launch(
            "arguments",
            rank,
            int(world_size),
            _optional_int(env, "LOCAL_RANK"),
            _optional_int(env, "LOCAL_WORLD_SIZE"),
            env.get("MASTER_ADDR") or None,
            _optional_int(env, "MASTER_PORT"),
            _agent_store(env),
        )
        _log(launch, "rank= and world_size= given")
        return launch
    launch, origin = _detect(env)
    if launch is None:
        raise LaunchError(origin)
    if rank is not None or world_size is not None:
        rank = launch.rank if rank is None else int(rank)
        world_size = launch.world_size if world_size is None else int(world_size)
        launch = Launch(
            "arguments",
            _checked_rank(rank, world_size, "rank", "world_size"),
            world_size,
            launch.local_rank,
            launch.local_world_size,
            launch.master_addr,
            launch.master_port,
            launch.agent_store,
        )
        origin = f"rank= or world_size= given, the rest from {origin}"
    _log(launch, origin)
    return launch


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The Launch of the launcher that started this process, or None where no launcher's
    variables are set. Raises LaunchError for a partial or contradictory environment."""
    launch, _ = _detect(os.environ if environ is None else environ)
    return launch


def init_process_group(backend: Optional[str] = "ringcomm", **kwargs) -> Launch:
    """dist.init_process_group(backend, **kwargs) under any launcher: discovers the launch
    (rank= and world_size= in kwargs are taken as given), exports its env:// variables and
    initialises the default group with its rank and world size. Returns the Launch."""
    import torch.distributed as dist

    launch = discover(kwargs.pop("rank", None), kwargs.pop("world_size", None))
    launch.export()
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, **kwargs)
    return launch


def expand_hostlist(hostlist: str) -> list:
    """The host names of a SLURM hostlist, in order: "node[01-03,07],gpu3" is node01, node02,
    node03, node07, gpu3. Ranges keep the width of their first bound ("[08-10]": 08, 09, 10);
    several bracket groups in one name expand left to right ("r[1-2]n[1-2]": r1n1, r1n2, r2n1,
    r2n2)."""
    hosts = []
    for name in _split_top_level(hostlist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(\[[^\[\]]*\])?", name):
            values = _expand_ranges(ranges[1:-1], hostlist) if ranges else [""]
            expanded = [head + literal + value for head in expanded for value in values]
        hosts += expanded
    return hosts


def _split_top_level(hostlist: str) -> list:
    """The comma-separated names of a hostlist; commas inside brackets belong to a range."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(hostlist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise LaunchError(f"hostlist {hostlist!r}: unbalanced or nested brackets")
        if char == "," and depth == 0:
            name = hostlist[start:i].strip()
            if not name:
                raise LaunchError(f"hostlist {hostlist!r}: an empty host name")
            names.append(name)
            start = i + 1
    if depth:
        raise LaunchError(f"hostlist {hostlist!r}: unbalanced or nested brackets")
    return names


def _expand_ranges(ranges: str, hostlist: str) -> list:
    values = []
    for part in ranges.split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:-([0-9]+))?\s*", part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise LaunchError(f"hostlist {hostlist!r}: {part!r} is not a number or range")
        low, high = match[1], match[2] or match[1]
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return values


def _tasks_per_node(text: str) -> list:
    """SLURM_STEP_TASKS_PER_NODE's counts, one per node: "4(x2),3" is [4, 4, 3]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
        if match is None:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE={text}: not counts like 4(x2),3")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


# -- the launchers ---------------------------------------------------------------------------

# The MPI launchers' variables: (launcher, name, rank, size, local rank, local size).
_MPI = (
    (
        "openmpi",
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "MPICH / PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)

# SLURM numbers the steps srun starts from 0; the batch script, the extern and the interactive
# steps have reserved ids from this one up.
_SLURM_FIRST_RESERVED_STEP = 0xFFFFFFF0


def _detect(env: Mapping[str, str]):
    """(Launch, where it came from) or (None, why no launcher was found)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        launch, origin = _env_launch(env)
        inner = _nested(env) if launch.launcher == "env" else None
        # A launcher that starts several ranks per task (torch.multiprocessing inside srun) sets a
        # larger WORLD_SIZE; the same size with another rank is RANK exported to every task alike.
        if inner is not None and inner[1][2] == launch.world_size and inner[1][1] != launch.rank:
            kind, (entry, rank, size) = inner
            rank_var, size_var = ("SLURM_PROCID", "SLURM_NTASKS") if kind == "slurm" else entry[2:4]
            raise LaunchError(
                f"RANK={launch.rank} WORLD_SIZE={launch.world_size} contradict the launcher's "
                f"{rank_var}={rank} {size_var}={size}: unset RANK and WORLD_SIZE to take the "
                f"launcher's, or set them per rank"
            )
        return launch, origin
    inner = _nested(env)
    if inner is not None:
        kind, ranks = inner
        return (_slurm_launch if kind == "slurm" else _mpi_launch)(env, *ranks)
    job = env.get("SLURM_JOB_ID")
    if job:
        return None, (
            f"no launcher found: this is SLURM job {job} but not a task of an srun "
            f"step (SLURM_STEP_ID is not set, as in a batch script): start the ranks "
            f"with srun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    return None, (
        "no launcher found: run under torchrun, srun, mpirun or mpiexec, set RANK, "
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or pass rank= and world_size="
    )


def _nested(env: Mapping[str, str]):
    """("slurm", (step, rank, size)) for a task of an srun step, ("mpi", (the _MPI entry, rank,
    size)) for an MPI launcher's rank, or None."""
    slurm, mpi = _slurm_ranks(env), _mpi_ranks(env)
    # An MPI launcher inside a SLURM allocation leaves the allocation's variables to its ranks,
    # describing the batch script or the daemons srun started for it; srun's own PMI (--mpi=pmi2)
    # gives the same rank and size as SLURM.
    if slurm is not None and (mpi is None or mpi[1:] == slurm[1:]):
        return "slurm", slurm
    return None if mpi is None else ("mpi", mpi)


def _env_launch(env: Mapping[str, str]):
    """torchrun's variables, or the same set by hand or by a PyTorchJob."""
    _require(env, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), "the env:// variables")
    torchrun = bool(env.get("TORCHELASTIC_RUN_ID"))
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _optional_int(env, "LOCAL_RANK")
    local_world = _optional_int(env, "LOCAL_WORLD_SIZE")
    _checked_rank(rank, world, "RANK", "WORLD_SIZE")
    if local_rank is not None and local_world is not None:
        _checked_rank(local_rank, local_world, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    launch = Launch(
        "torchrun" if torchrun else "env",
        rank,
        world,
        local_rank,
        local_world,
        env["MASTER_ADDR"],
        _port(env, "MASTER_PORT"),
        _agent_store(env),
    )
    origin = (
        "torchrun (TORCHELASTIC_RUN_ID set)"
        if torchrun
        else "the env:// variables, without torchrun (no TORCHELASTIC_RUN_ID)"
    )
    return launch, f"{origin}: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"


def _slurm_ranks(env: Mapping[str, str]):
    """(step, rank, size) of a task of an srun step, or None: a batch script has no step id."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not re.fullmatch(r"[0-9]+", step) or int(step) >= _SLURM_FIRST_RESERVED_STEP:
        return None
    _require(env, ("SLURM_PROCID", "SLURM_NTASKS"), f"srun's variables (step {step})")
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    return step, _checked_rank(rank, world, "SLURM_PROCID", "SLURM_NTASKS"), world


def _slurm_launch(env: Mapping[str, str], step: str, rank: int, world: int):
    local_world = None
    if env.get("SLURM_STEP_TASKS_PER_NODE") and env.get("SLURM_NODEID"):
        counts = _tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        node = _int(env, "SLURM_NODEID")
        local_world = counts[node] if node < len(counts) else None
    if env.get("MASTER_ADDR"):
        addr, addr_from = env["MASTER_ADDR"], "MASTER_ADDR"
    else:
        listed = next(
            (name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(name)), None
        )
        if listed is None:
            raise LaunchError(
                "SLURM: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, "
                "so rank 0's host is unknown: set MASTER_ADDR"
            )
        addr, addr_from = expand_hostlist(env[listed])[0], f"the first host of {listed}"
        here = env.get("SLURMD_NODENAME")
        if rank == 0 and here and here != addr:
            raise LaunchError(
                f"SLURM: rank 0 runs on {here}, not on {addr}, the first host of "
                f"{listed}={env[listed]} (a task distribution that does not put "
                f"rank 0 there): set MASTER_ADDR to rank 0's host"
            )
    if env.get("MASTER_PORT"):
        port, port_from = _port(env, "MASTER_PORT"), "MASTER_PORT"
    elif re.fullmatch(r"[0-9]+", env.get("SLURM_JOB_ID", "")):
        port, port_from = PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN, "from SLURM_JOB_ID"
    else:
        raise LaunchError(
            f"SLURM: SLURM_JOB_ID={env.get('SLURM_JOB_ID', '')!r} is no job number "
            f"to derive a port from: set MASTER_PORT"
        )
    launch = Launch(
        "slurm", rank, world, _optional_int(env, "SLURM_LOCALID"), local_world, addr, port
    )
    return launch, (
        f"srun (SLURM step {step}): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; "
        f"address: {addr_from}, port: {port_from}"
    )


def _mpi_ranks(env: Mapping[str, str]):
    """(the _MPI entry, rank, size) of the first MPI launcher whose variables are set, or None."""
    for entry in _MPI:
        rank_var, size_var = entry[2], entry[3]
        if rank_var in env or size_var in env:
            _require(env, (rank_var, size_var), f"{entry[1]}'s variables")
            rank, world = _int(env, rank_var), _int(env, size_var)
            return entry, _checked_rank(rank, world, rank_var, size_var), world
    return None


def _mpi_launch(env: Mapping[str, str], entry, rank: int, world: int):
    """An MPI launcher gives no address of rank 0: MASTER_ADDR, else 127.0.0.1 when every rank
    is on this host. The port: MASTER_PORT, else derived from what names the job alike on every
    rank: Open MPI's job (PMIX_NAMESPACE, Open MPI 4's OMPI_MCA_ess_base_jobid); for Hydra, the
    pid of this host's proxy, the same only among the ranks of one host."""
    launcher, name, rank_var, size_var, local_rank_var, local_size_var = entry
    local_rank, local_world = _optional_int(env, local_rank_var), _optional_int(env, local_size_var)
    one_host = local_world == world
    if env.get("MASTER_ADDR"):
        addr, addr_from = env["MASTER_ADDR"], "MASTER_ADDR"
    elif one_host:
        addr, addr_from = "127.0.0.1", "127.0.0.1 (every rank on this host)"
    else:
        raise LaunchError(
            f"{name}: {size_var}={world} but {local_size_var}="
            f"{env.get(local_size_var) or '(not set)'}: ranks on several hosts need "
            f"MASTER_ADDR set to rank 0's host (mpirun -x MASTER_ADDR=host, "
            f"mpiexec -genv MASTER_ADDR host)"
        )
    job = None
    if launcher == "openmpi":
        job_var = next(
            (var for var in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid") if env.get(var)), None
        )
        if job_var is not None:
            job = job_var, zlib.crc32(env[job_var].encode())
    elif one_host:
        proxy = _hydra_proxy()
        if proxy is not None:
            job = "the pid of this host's Hydra proxy", proxy
    if env.get("MASTER_PORT"):
        port, port_from = _port(env, "MASTER_PORT"), "MASTER_PORT"
    elif job is not None:
        port, port_from = PORT_BASE + job[1] % PORT_SPAN, f"from {job[0]}"
    else:
        raise LaunchError(
            f"{name}: nothing in the environment names this job alike on every "
            f"rank to derive a port from: set MASTER_PORT"
        )
    return (
        Launch(launcher, rank, world, local_rank, local_world, addr, port),
        f"{name}: {rank_var}, {size_var}, {local_rank_var}; address: {addr_from}, "
        f"port: {port_from}",
    )


def _hydra_proxy() -> Optional[int]:
    """The pid of the Hydra proxy (hydra_pmi_proxy; Intel MPI's pmi_proxy) this process descends
    from: it starts every rank of its host, so its pid names the job on that host."""
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if name in ("hydra_pmi_proxy", "pmi_proxy"):
            return pid
        pid = int(fields.split()[1])
    return None


# -- reading variables -----------------------------------------------------------------------


def _require(env: Mapping[str, str], names, what: str) -> None:
    missing = [name for name in names if not env.get(name)]
    if missing:
        present = [f"{name}={env[name]}" for name in names if env.get(name)]
        raise LaunchError(
            f"{what} incomplete: {', '.join(missing)} not set"
            + (f" (beside {', '.join(present)})" if present else "")
        )


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    if not re.fullmatch(r"[0-9]+", value):
        raise LaunchError(f"{name}={env[name]!r} is not a non-negative integer")
    return int(value)


def _optional_int(env: Mapping[str, str], name: str) -> Optional[int]:
    return _int(env, name) if env.get(name) else None


def _port(env: Mapping[str, str], name: str) -> int:
    port = _int(env, name)
    if not 0 < port < 65536:
        raise LaunchError(f"{name}={port} is not a TCP port")
    return port


def _checked_rank(rank: int, world: int, rank_name: str, world_name: str) -> int:
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"{rank_name}={rank} is not a rank of {world_name}={world}")
    return rank


def _agent_store(env: Mapping[str, str]) -> bool:
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _log(launch: Launch, origin: str) -> None:
    local = (
        ""
        if launch.local_rank is None
        else f", local rank {launch.local_rank}"
        + ("" if launch.local_world_size is None else f" of {launch.local_world_size}")
    )
    logger.info(
        "rank %d of %d%s; ranks meet at %s:%s; launched by %s",
        launch.rank,
        launch.world_size,
        local,
        launch.master_addr,
        launch.master_port,
        origin,
    )
