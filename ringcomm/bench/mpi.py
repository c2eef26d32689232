"""Open MPI's MPI_Allreduce timed the way ringcomm.bench times its rows: the `--compare mpi` anchor.

    python -m ringcomm.bench --ranks 2 --sizes 8,64K,1M --compare mpi      # the usual way
    mpiexec --allow-run-as-root --oversubscribe --bind-to none -n 2 \\
        python ringcomm/bench/mpi.py --sizes 8,64K,1M                      # on its own

ringcomm.bench starts this file under mpiexec from its rank 0 with --serve and drives it over
stdin/stdout, one JSON line each way per request, so that its samples interleave with ringcomm's
(and gloo's) in the same run: {"cmd": "sample", "count": N, "iters": I, "warmup": W,
"sample_warmup": S} times one sample (buffers of N elements, made and warmed up with W operations
when N changes; S untimed operations before the sample, as the bench runs before each library's),
{"cmd": "check"} counts wrong elements, {"cmd": "quit"} (or end of input) ends the job. Between
requests every rank waits without spinning (rank 0 in a blocking read of stdin, the others
polling a non-blocking broadcast with growing sleeps), so an idle MPI job takes no CPU from the
library being timed.

On its own it runs every size itself and prints one JSON row per size.

Methodology, as ringcomm.bench: MPI_Allreduce in place (MPI_IN_PLACE: ringcomm's all_reduce is
in place too) on inputs of small integers (the same as ringcomm's rows, so every element has one
right answer), `warmup` untimed operations per size, then samples of `iters` back-to-back
operations timed on rank 0's clock after an MPI_Barrier; the median is reported.

Only numpy, mpi4py and common.py (the standard library): no torch and no ringcomm._C, so that the
bench can run it by path and the MPI ranks start quickly and load nothing they do not use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

if __package__:
    from .common import default_iters, parse_size
else:  # run by path (see above): common.py lies beside this file, which Python put on sys.path
    from common import default_iters, parse_size

# The bench's -d names that MPI can reduce (it has no standard float16 or bfloat16).
DTYPES = {
    "float": np.float32,
    "float32": np.float32,
    "double": np.float64,
    "float64": np.float64,
    "int32": np.int32,
    "int": np.int32,
    "int64": np.int64,
    "int8": np.int8,
    "uint8": np.uint8,
}
OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
REFERENCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
# Commands as broadcast to every rank: [command, count, iters, warmup, sample_warmup].
QUIT, SAMPLE, CHECK = 0, 1, 2


class Allreduce:
    """In-place MPI_Allreduce of `count` elements."""

    def __init__(self, comm, count: int, dtype, op: str):
        self.comm, self.count, self.dtype, self.op = comm, count, dtype, op
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.buf = self.input(self.rank)

    def input(self, rank: int):
        """ringcomm.bench's inputs: arange % 5 + 1 + rank % 3, exact in every dtype."""
        return (np.arange(self.count, dtype=np.float64) % 5 + 1 + rank % 3).astype(self.dtype)

    def run(self, n: int):
        for _ in range(n):
            self.comm.Allreduce(MPI.IN_PLACE, self.buf, op=OPS[self.op])

    def sample(self, iters: int) -> float:
        """Seconds per operation on rank 0's clock (every rank returns its own)."""
        self.comm.Barrier()
        start = time.perf_counter()
        self.run(iters)
        return (time.perf_counter() - start) / iters

    def wrong(self) -> int:
        """One operation on fresh inputs; elements differing from a float64 reference, all ranks."""
        self.buf[:] = self.input(self.rank)
        self.run(1)
        expect = self.input(0).astype(np.float64)
        for r in range(1, self.world):  # one rank's input at a time: 64 MiB x 4 ranks fits
            REFERENCE[self.op](expect, self.input(r), out=expect)
        expect = expect.astype(self.dtype).astype(np.float64)
        ok = np.isclose(self.buf.astype(np.float64), expect, rtol=1e-6, atol=1e-6)
        mine = np.array([np.count_nonzero(~ok)], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.SUM)
        return int(mine[0])


def send(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def next_command(comm, cmd) -> None:
    """Rank 0 reads one request from stdin; every rank gets it as `cmd`. Waits without spinning."""
    if comm.Get_rank() == 0:
        line = sys.stdin.readline()
        req = json.loads(line) if line.strip() else {"cmd": "quit"}
        cmd[:] = [
            {"quit": QUIT, "sample": SAMPLE, "check": CHECK}[req["cmd"]],
            req.get("count", 0),
            req.get("iters", 0),
            req.get("warmup", 0),
            req.get("sample_warmup", 0),
        ]
    request = comm.Ibcast(cmd, root=0)
    delay = 50e-6
    while not request.Test():  # a blocking MPI call would busy-poll for as long as it waits
        time.sleep(delay)
        delay = min(2 * delay, 2e-3)


def serve(comm, dtype, op: str) -> None:
    cmd = np.zeros(5, dtype=np.int64)
    case = None
    if comm.Get_rank() == 0:
        send(
            {
                "ready": True,
                "ranks": comm.Get_size(),
                "library": MPI.Get_library_version().splitlines()[0].strip(),
            }
        )
    while True:
        next_command(comm, cmd)
        what, count, iters, warmup, sample_warmup = (int(x) for x in cmd)
        if what == QUIT:
            return
        if what == SAMPLE:
            if case is None or case.count != count:
                case = Allreduce(comm, count, dtype, op)
                case.run(warmup)
            case.run(sample_warmup)
            t = case.sample(iters)
            if comm.Get_rank() == 0:
                send({"time_s": t})
        else:
            wrong = case.wrong()
            if comm.Get_rank() == 0:
                send({"wrong": wrong})


def standalone(comm, dtype, op: str, args) -> None:
    rank, world = comm.Get_rank(), comm.Get_size()
    elem = np.dtype(dtype).itemsize
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        case = Allreduce(comm, max(1, nbytes // elem), dtype, op)
        iters = args.iters or default_iters(case.count * elem)
        case.run(args.warmup_iters)
        samples = [case.sample(iters) for _ in range(args.repeats)]
        wrong = case.wrong()
        t = statistics.median(samples)
        algbw = case.count * elem / t / 1e9
        if rank == 0:
            send(
                {
                    "size": case.count * elem,
                    "count": case.count,
                    "ranks": world,
                    "time_us": t * 1e6,
                    "algbw": algbw,
                    "busbw": algbw * 2 * (world - 1) / world,
                    "wrong": wrong,
                    "samples_us": [s * 1e6 for s in samples],
                }
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ringcomm-bench-mpi", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help="take requests on stdin (ringcomm.bench)")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPES), default="float")
    p.add_argument("-o", "--op", choices=sorted(OPS), default="sum")
    p.add_argument("--sizes", default="8,4K,64K,1M,16M,64M", help="on its own: sizes to run")
    p.add_argument("-n", "--iters", type=int, default=0, help="on its own: operations per sample")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    if args.serve:
        serve(comm, DTYPES[args.datatype], args.op)
    else:
        standalone(comm, DTYPES[args.datatype], args.op, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
