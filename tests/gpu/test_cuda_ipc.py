"""ringcomm's CUDA IPC transport (csrc/transport/cuda_ipc/, ringcomm/device.py) with every rank a
process on ONE GPU: all_reduce of every op, dtype and size of the grid below, bit for bit against
every rank's input folded in rank order on the GPU (the order one_shot and shared_buffer fold
in), and each window algorithm by name on whole numbers (exact in any order: the ring folds each
block in its own); all_gather of every dtype and size, every block bit for bit; reduce_scatter
of every op, dtype and size, each rank's block bit for bit against the same fold; all_to_all of
every dtype and size; then a rank killed while the others run collectives, who must raise within
the timeout, never hang; and ranks that issue different collectives, who must all raise
MismatchError at once, naming the operations; sends and receives of every size around a ring
of ranks, and a receive of another size than its send. Each runs without MPS and, where
nvidia-cuda-mps-control exists, under an MPS daemon of its own (pipe and log directories in a
temporary directory, stopped after; the GPU's compute mode is left alone)."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = ["sum", "avg", "min", "max"]
# Elements: none, one, odd, a view one element off a 16-byte boundary, 2^20 + 3 (past the
# one-shot sizes), and 64 MiB (several board rounds).
SIZES = [0, 1, 999, ("unaligned", 4097), (1 << 20) + 3, ("bytes", 64 << 20)]
ALGORITHMS = ["one_shot", "shared_buffer", "ring"]
MPS_CONTROL = shutil.which("nvidia-cuda-mps-control")


def elements(size, dtype):
    if isinstance(size, tuple):
        kind, n = size
        return n // torch.tensor([], dtype=dtype).element_size() if kind == "bytes" else n
    return size


def contribution(case, rank, n, dtype, whole):
    gen = torch.Generator(device="cuda").manual_seed(7919 * case + rank)
    if whole:
        x = torch.randint(-8, 9, (n,), generator=gen, device="cuda", dtype=torch.int32)
    else:
        x = torch.randn(n, generator=gen, device="cuda")
    return x.to(dtype)


def reference(case, world, n, dtype, op, whole):
    """Every rank's contribution folded in rank order in `dtype`, each step rounded (torch's CUDA
    arithmetic on half types computes in float and rounds, as ringcomm's kernels do); avg divides
    by a tensor, not a scalar, so that torch divides rather than multiplying by a reciprocal."""
    acc = contribution(case, 0, n, dtype, whole)
    for r in range(1, world):
        x = contribution(case, r, n, dtype, whole)
        acc = (
            torch.minimum(acc, x)
            if op == "min"
            else torch.maximum(acc, x)
            if op == "max"
            else acc + x
        )
    return acc / torch.full_like(acc, world) if op == "avg" else acc


def placed(t, size):
    """t itself, or a copy of it one element into a bigger buffer (a data pointer off 16 bytes)."""
    if isinstance(size, tuple) and size[0] == "unaligned":
        room = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = room[1:]
        view.copy_(t)
        return view
    return t


def communicator(store_path, rank, world, timeout_s):
    from ringcomm.device import DeviceCommunicator

    torch.cuda.set_device(0)
    store = torch.distributed.FileStore(store_path, world)
    comm = DeviceCommunicator(
        store, rank, world, timeout=timedelta(seconds=timeout_s), transports=("cuda_ipc",)
    )
    assert comm.transport == "cuda_ipc", comm.refused
    return comm


def grid_rank(rank, world, store_path, results):
    try:
        comm = communicator(store_path, rank, world, 60)
        case = 0
        for dtype in DTYPES:
            for op in OPS:
                for size in SIZES:
                    case += 1
                    n = elements(size, dtype)
                    t = placed(contribution(case, rank, n, dtype, False), size)
                    comm.all_reduce(t, op)
                    comm.synchronize()
                    if not torch.equal(t, reference(case, world, n, dtype, op, False)):
                        raise AssertionError(f"auto {dtype} {op} {size}: not the rank-order fold")
        for algorithm in ALGORITHMS:
            for dtype, op in (
                (torch.float32, "sum"),
                (torch.bfloat16, "avg"),
                (torch.float16, "max"),
            ):
                for size in (1, 999, ("unaligned", 4097), (1 << 20) + 3):
                    case += 1
                    n = elements(size, dtype)
                    t = placed(contribution(case, rank, n, dtype, True), size)
                    comm.all_reduce(t, op, algorithm)
                    comm.synchronize()
                    if not torch.equal(t, reference(case, world, n, dtype, op, True)):
                        raise AssertionError(f"{algorithm} {dtype} {op} {size}: wrong result")
        for dtype in DTYPES:
            for size in SIZES:
                case += 1
                n = elements(size, dtype)
                mine = placed(contribution(case, rank, n, dtype, False), size)
                out = placed(torch.empty(world * n, dtype=dtype, device="cuda"), size)
                comm.all_gather(out, mine)
                comm.synchronize()
                every = [contribution(case, r, n, dtype, False) for r in range(world)]
                if not torch.equal(out, torch.cat(every)):
                    raise AssertionError(f"all_gather {dtype} {size}: not every rank's block")
        for dtype in DTYPES:
            for op in OPS:
                for size in SIZES:
                    case += 1
                    n = elements(size, dtype) // world  # a block
                    whole = placed(contribution(case, rank, world * n, dtype, False), size)
                    before = whole.clone()
                    out = torch.empty(n, dtype=dtype, device="cuda")
                    comm.reduce_scatter(out, whole, op)
                    comm.synchronize()
                    want = reference(case, world, world * n, dtype, op, False)
                    if not torch.equal(out, want[rank * n : (rank + 1) * n]):
                        raise AssertionError(f"reduce_scatter {dtype} {op} {size}: wrong block")
                    if not torch.equal(whole, before):
                        raise AssertionError(f"reduce_scatter {dtype} {op} {size}: input changed")
        for dtype in DTYPES:
            for size in SIZES:
                case += 1
                n = elements(size, dtype) // world
                mine = placed(contribution(case, rank, world * n, dtype, False), size)
                out = torch.empty(world * n, dtype=dtype, device="cuda")
                comm.all_to_all(out, mine)
                comm.synchronize()
                every = [contribution(case, r, world * n, dtype, False) for r in range(world)]
                want = torch.cat([e[rank * n : (rank + 1) * n] for e in every])
                if not torch.equal(out, want):
                    raise AssertionError(f"all_to_all {dtype} {size}: wrong blocks")
        comm.close()
        results.put((rank, "ok"))
    except BaseException as e:  # reported to the parent, which fails the test with it
        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def kill_rank(rank, world, store_path, results, victim):
    import ringcomm

    comm = communicator(store_path, rank, world, 20)
    t = torch.ones(1 << 22, device="cuda")
    results.put((rank, "ready"))
    start = time.monotonic()
    outcome = "no error within 60 s"
    while time.monotonic() - start < 60:
        try:
            for _ in range(4):
                comm.all_reduce(t)
            comm.synchronize()
        except ringcomm.RingcommError as e:
            outcome = f"{type(e).__name__}: {e}"
            break
    raised_at = time.time()
    try:  # the stream the failure released: it must drain, whatever it computed
        torch.cuda.synchronize()
        drained = "drained"
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        drained = f"torch.cuda.synchronize raised {e!r}"
    results.put((rank, (outcome, raised_at, drained)))
    os._exit(0)  # the transport failed: nothing to release


def mismatch_rank(rank, world, store_path, results, case):
    import ringcomm

    comm = communicator(store_path, rank, world, 20)
    t = torch.ones(1000, device="cuda")
    comm.all_reduce(t)  # one that agrees first
    start = time.monotonic()
    try:
        if case == "count" and rank == 1:
            comm.all_reduce(torch.ones(2000, device="cuda"))
        elif case == "collective" and rank == 2:
            comm.all_gather(torch.empty(1000 * world, device="cuda"), t)
        else:
            comm.all_reduce(t)
        comm.synchronize()
        outcome = "no error"
    except ringcomm.RingcommError as e:
        outcome = f"{type(e).__name__}: {e}"
    results.put((rank, (outcome, time.monotonic() - start)))
    os._exit(0)


def messages_rank(rank, world, store_path, results):
    """Each size sent to rank + 1 while receiving from rank - 1 (with 2 ranks, both ways at
    once), every element checked; then a receive of another size than its send."""
    import ringcomm

    comm = communicator(store_path, rank, world, 20)
    outcome = "ok"
    try:
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        for k, n in enumerate([0, 1, 999, (1 << 20) + 3, 3 << 20]):
            out = torch.arange(n, dtype=torch.float32, device="cuda") + 1000 * rank + k
            into = torch.full((n + 1,), -1.0, device="cuda")
            sent, got = comm.send(out, nxt), comm.recv(into[:n], prev)
            sent.wait()
            got.wait()
            want = torch.arange(n, dtype=torch.float32, device="cuda") + 1000 * prev + k
            if not torch.equal(into[:n], want) or into[n].item() != -1.0:
                outcome = f"size {n}: wrong bytes from rank {prev}"
                break
        comm.synchronize()
        if outcome == "ok":
            start = time.monotonic()
            try:
                if rank == 0:
                    comm.send(torch.ones(1000, device="cuda"), 1)
                elif rank == 1:
                    comm.recv(torch.empty(2000, device="cuda"), 0)
                # The pair's side that sees the mismatch gives up for every rank: this
                # all-reduce raises everywhere.
                comm.all_reduce(torch.ones(8, device="cuda"))
                comm.synchronize()
                outcome = "no error"
            except ringcomm.RingcommError as e:
                outcome = f"{type(e).__name__} after {time.monotonic() - start:.1f} s: {e}"
    except Exception:  # noqa: BLE001 - reported to the test
        outcome = traceback.format_exc()
    results.put((rank, outcome))
    os._exit(0)


def spawn(target, world, args, env):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    saved = dict(os.environ)
    os.environ.update(env)  # spawned children take the environment at start
    try:
        procs = [ctx.Process(target=target, args=(r, world) + args(results)) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return procs, results


def collect(procs, results, count, timeout):
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        try:
            rank, value = results.get(timeout=0.5)
            got.setdefault(rank, []).append(value)
        except Exception:  # noqa: BLE001 - queue.Empty: look again
            if all(p.exitcode is not None for p in procs) and results.empty():
                break
    return got


def finish(procs, timeout):
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    return alive


@contextmanager
def gpu_sharing(mps):
    """The environment ranks run in: none without MPS; with it, a daemon's pipe directory."""
    if not mps:
        yield {}
        return
    if MPS_CONTROL is None:
        pytest.skip("no nvidia-cuda-mps-control on this machine")
    with tempfile.TemporaryDirectory(prefix="ringcomm-mps-") as tmp:
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(tmp, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(tmp, "log"),
        }
        for d in env.values():
            os.makedirs(d)
        started = subprocess.run(
            [MPS_CONTROL, "-d"],
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if started.returncode != 0:
            pytest.skip(f"the MPS daemon did not start: {started.stderr or started.stdout}")
        try:
            yield env
        finally:
            subprocess.run(
                [MPS_CONTROL],
                input="quit\n",
                env=dict(os.environ, **env),
                capture_output=True,
                text=True,
                timeout=30,
            )


@pytest.mark.parametrize("mps", [False, True], ids=["time-sliced", "mps"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_all_reduce_grid_on_one_gpu(world, mps, tmp_path):
    with gpu_sharing(mps) as env:
        procs, results = spawn(grid_rank, world, lambda q: (str(tmp_path / "store"), q), env)
        got = collect(procs, results, world, timeout=420)
        alive = finish(procs, 10)
    assert not alive, f"ranks still running: {got}"
    assert all(got.get(r) == ["ok"] for r in range(world)), got


@pytest.mark.parametrize("mps", [False, True], ids=["time-sliced", "mps"])
def test_a_killed_rank_makes_the_others_raise_within_the_timeout(mps, tmp_path):
    world, victim = 4, 2
    with gpu_sharing(mps) as env:
        procs, results = spawn(
            kill_rank, world, lambda q: (str(tmp_path / "store"), q, victim), env
        )
        ready = collect(procs, results, world, timeout=120)
        assert len(ready) == world, ready
        time.sleep(1.0)  # every rank is in its loop of collectives
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed_at = time.time()
        got = collect(procs, results, world - 1, timeout=90)
        alive = finish(procs, 10)
    assert not alive, f"ranks still running: {got}"
    for r in range(world):
        if r == victim:
            continue
        outcome, raised_at, drained = got[r][-1]
        # The communicator's timeout is 20 s; the watchdog sees the process gone much sooner.
        assert raised_at - killed_at < 25, (r, outcome, raised_at - killed_at)
        assert f"rank {victim}" in outcome and ("exited" in outcome or "gave up" in outcome), (
            r,
            outcome,
        )
        assert drained == "drained", (r, drained)


@pytest.mark.parametrize("case", ["count", "collective"])
def test_mismatched_collectives_raise_on_every_rank(case, tmp_path):
    world = 3
    procs, results = spawn(mismatch_rank, world, lambda q: (str(tmp_path / "store"), q, case), {})
    got = collect(procs, results, world, timeout=120)
    alive = finish(procs, 10)
    assert not alive, f"ranks still running: {got}"
    for r in range(world):
        outcome, took = got[r][-1]
        assert outcome.startswith("MismatchError") and "mismatched operations" in outcome, (r, got)
        # Found when the operations are posted: well within the 20 s timeout.
        assert took < 10, (r, outcome, took)
    odd = "count=2000" if case == "count" else "all_gatherv"
    assert all(odd in got[r][-1][0] for r in range(world)), got


@pytest.mark.parametrize("world", [2, 3])
def test_send_and_recv_on_one_gpu(world, tmp_path):
    procs, results = spawn(messages_rank, world, lambda q: (str(tmp_path / "store"), q), {})
    got = collect(procs, results, world, timeout=120)
    alive = finish(procs, 10)
    assert not alive, f"ranks still running: {got}"
    for r in range(world):
        outcome = got[r][-1]
        # The pair's sizes differ: found when posted, well within the 20 s timeout.
        assert outcome.startswith("MismatchError after") and "mismatched messages" in outcome, got
        assert "count=1000" in outcome and "count=2000" in outcome, got
        assert float(outcome.split()[2]) < 10, got
