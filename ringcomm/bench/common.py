"""What the benchmarks share, with each other and with the tests: sizes as text, operations per
sample, a free port, the launcher of local ranks, and what every JSON report says of its run.

The standard library only: mpi.py runs by path under mpiexec, without torch or ringcomm, and
imports this module from beside it.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import traceback

SIZE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def parse_size(text: str) -> int:
    """Bytes of "8", "4K", "1.5M", "1G" (binary units; a trailing B is allowed)."""
    text = text.strip().upper().rstrip("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def format_size(nbytes: int) -> str:
    """8 B, 4 KiB, 1.5 MiB: the sizes of docs/performance.md's tables."""
    for unit, scale in SIZE_UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def default_iters(nbytes: int) -> int:
    """Operations per sample: 200 up to 64 KiB, else 256 MiB's worth (at least 3)."""
    return 200 if nbytes <= 65536 else max(3, (256 << 20) // nbytes)


def free_port() -> int:
    """A loopback TCP port that nothing listens on now: a MASTER_PORT for local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict:
    """The env:// variables torchrun gives rank `rank` of `world` ranks on one host."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def launch(world: int, run, argv=None) -> int:
    """Starts `world` local ranks, each under rank_env's variables, waits for them and returns the
    exit code furthest from 0. A rank is a fork of this process that calls run(): this process
    has imported torch already, and a fresh interpreter per rank would import it again (2.5 s of
    CPU each on two cores). With `argv`, each rank is instead a fresh interpreter running
    `python *argv`: CUDA does not work in a fork of a process that has used it."""
    port = free_port()
    sys.stdout.flush()  # else a fork writes out again what this process has buffered
    sys.stderr.flush()
    ranks = []
    for rank in range(world):
        env = rank_env(rank, world, port)
        if argv is not None:
            ranks.append(subprocess.Popen([sys.executable, *argv], env=dict(os.environ, **env)))
            continue
        pid = os.fork()
        if pid == 0:
            os._exit(forked_rank(run, env))
        ranks.append(pid)
    codes = [
        p.wait() if argv is not None else os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
        for p in ranks
    ]
    return max(codes, key=abs)


def forked_rank(run, env: dict) -> int:
    """A forked rank's life, ended as an interpreter's would be: SystemExit's code (its message
    printed), or a traceback and 1, then the exit handlers (the timeline's part is written by
    one)."""
    os.environ.update(env)
    try:
        run()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def cpu_name() -> str:
    """The CPU's model and how many vCPUs this machine has: "AMD EPYC 7B13, 2 vCPUs"."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} vCPUs"


def commit() -> str:
    """The git revision of the checkout this package runs from, else the installed version."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.exists(os.path.join(root, ".git")):
        try:
            return subprocess.run(
                ["git", "-C", root, "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return importlib.metadata.version("ringcomm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_metadata(gpu: str | None = None) -> dict:
    """The top-level fields of every JSON report of the benchmarks: the machine (`gpu`, a GPU's
    name, for runs timed on one; else cpu_name()), the commit and the date (ISO)."""
    return {
        "machine": gpu or cpu_name(),
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
    }
