"""Runs a function on N real processes, over the transport the test module runs with.

Each rank is a process with its own ringcomm.Communicator, rendezvousing through a torch
FileStore in a temporary directory removed when the ranks are done. Ranks are forked from a clean,
single-threaded fork server (not from the pytest process, whose torch may have started OpenMP
threads: a fork from there can deadlock in the child). Results (or exceptions) come back to the
test; a rank that does not finish within `timeout` seconds fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import queue as queue_module
import tempfile
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from ringcomm.bench.common import free_port

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "ringcomm", "numpy", "pytest"])


class RankFailed(AssertionError):
    pass


def build_native(name: str, out_dir: str) -> str:
    """Compiles tests/native/<name>.cc against the installed core (libringcomm.so) into out_dir;
    skips the test where there is no C++ compiler."""
    import shutil
    import pytest
    import ringcomm

    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    here = os.path.dirname(os.path.abspath(__file__))
    library = os.path.dirname(ringcomm.__file__)
    binary = os.path.join(out_dir, name)
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            f"-I{os.path.dirname(here)}/csrc",
            f"{here}/native/{name}.cc",
            f"-L{library}",
            "-lringcomm",
            f"-Wl,-rpath,{library}",
            "-pthread",
            "-o",
            binary,
        ],
        check=True,
    )
    return binary


# Each rank's environment for a transport. conftest.py runs the tests marked every_transport once
# per entry (and sets `transport`); a test's own `env` wins over these.
TRANSPORTS = {
    "shm": lambda rank: {"RINGCOMM_TRANSPORT": "shm"},
    "tcp": lambda rank: {"RINGCOMM_TRANSPORT": "tcp"},
    # Two ranks per fake host: shared memory inside a host, TCP between hosts.
    "mixed": lambda rank: {"RINGCOMM_TRANSPORT": "auto", "RINGCOMM_HOST_ID": f"host{rank // 2}"},
}
transport = None


def _child(fn, rank, world, store_path, comm_timeout, queue, args, make_comm, with_store, env):
    try:
        os.environ.update(env)
        store = dist.FileStore(store_path, world)
        if make_comm:
            import ringcomm

            comm = ringcomm.Communicator(
                store, rank, world, timeout=timedelta(seconds=comm_timeout)
            )
            result = fn(comm, store, *args) if with_store else fn(comm, *args)
            comm.close()
        else:
            result = fn(store, rank, world, *args)
        # Plain pickle, not the queue's: torch would pass tensors as shared-memory handles that
        # die with this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(
    world: int,
    fn,
    *args,
    timeout: float = 60,
    comm_timeout: float = 30,
    make_comm: bool = True,
    with_store: bool = False,
    allow_errors: bool = False,
    env: dict | None = None,
    per_rank_env: dict | None = None,
):
    """Runs fn(comm, *args) on `world` ranks (fn(store, rank, world, *args) without make_comm;
    fn(comm, store, *args) with_store: the ranks' store, for handshakes beside the communicator).

    Returns the per-rank results. With allow_errors, a rank's exception is returned as
    ("error", text) instead of failing the test. `env` is added to each rank's environment, then
    per_rank_env[rank] (a dict) to that rank's.
    """
    with tempfile.TemporaryDirectory(prefix="ringcomm-test-") as tmp:
        return _run_ranks_in(
            tmp,
            world,
            fn,
            args,
            timeout,
            comm_timeout,
            make_comm,
            with_store,
            allow_errors,
            env,
            per_rank_env,
        )


def _run_ranks_in(
    tmp,
    world,
    fn,
    args,
    timeout,
    comm_timeout,
    make_comm,
    with_store,
    allow_errors,
    env,
    per_rank_env,
):
    store_path = os.path.join(tmp, "store")
    queue = CTX.Queue()

    def rank_env(r):
        out = TRANSPORTS[transport](r) if transport else {}
        out.update(env or {})
        out.update((per_rank_env or {}).get(r, {}))
        return out

    procs = [
        CTX.Process(
            target=_child,
            args=(
                fn,
                r,
                world,
                store_path,
                comm_timeout,
                queue,
                args,
                make_comm,
                with_store,
                rank_env(r),
            ),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = queue.get(timeout=0.2)
                results[rank] = (status, pickle.loads(value) if status == "ok" else value)
                continue
            except queue_module.Empty:
                pass
            for r, p in enumerate(procs):  # a rank that died without reporting
                if r not in results and p.exitcode is not None and queue.empty():
                    results[r] = ("error", f"rank {r} exited with code {p.exitcode}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(results))
                raise RankFailed(f"rank(s) {missing} did not finish within {timeout}s (hang?)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    out = []
    for r in range(world):
        status, value = results[r]
        if status == "error" and not allow_errors:
            raise RankFailed(f"rank {r} failed:\n{value}")
        out.append(("error", value) if status == "error" else value)
    return out


class Preempted(Exception):
    """What seconds_until_handler_runs's SIGALRM handler raises."""


def seconds_until_handler_runs(work, after: float = 0.3):
    """Waits on `work` (pending on a peer that has not joined) with a SIGALRM handler that raises
    Preempted due `after` seconds in: returns how long the wait took to give way to it, or a
    message if wait() returned without the handler running."""

    def handler(signum, frame):
        raise Preempted()

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, after)
    start = time.monotonic()
    try:
        work.wait()
    except Preempted:
        return time.monotonic() - start
    return "wait returned without the handler running"


def expect_error(fn, kind=None):
    """Calls fn, which must raise ringcomm.RingcommError, of class `kind` if given (a subclass:
    ringcomm.MismatchError, ...): (its message, seconds it took)."""
    import ringcomm

    start = time.monotonic()
    try:
        fn()
    except ringcomm.RingcommError as e:
        if kind is not None and type(e) is not kind:
            raise AssertionError(f"expected {kind.__name__}, got {type(e).__name__}: {e}") from e
        return str(e), time.monotonic() - start
    raise AssertionError("expected RingcommError")


def run_torchrun(
    tmp_path, script_text: str, nproc: int, timeout: float = 120, args=(), extra=()
) -> str:
    """Runs `script_text` under real torchrun with `nproc` local ranks (and torchrun's `extra`
    options); returns its stdout."""
    script = tmp_path / "job.py"
    script.write_text(script_text)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        *extra,
        str(script),
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
