"""Collective microbenchmark in nccl-tests's format, optionally side by side with torch's gloo.

    python -m ringcomm.bench --ranks 2 -b 8 -e 64M -f 4 --compare gloo
    torchrun --nproc-per-node 4 -m ringcomm.bench -b 8 -e 64M --coll all_reduce
    python -m ringcomm.bench --coll all_reduce_coalesced --tensors 1000 --tensor-bytes 1K-16K --compare gloo

Without RANK in the environment it launches `--ranks` local ranks itself (each one this module
under the env:// variables torchrun sets). Times are medians over --repeats samples of --iters
back-to-back operations (rank 0's clock, after a barrier). algbw = size / time; busbw = algbw x
2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter and all_gather, 1 for broadcast and reduce.
#wrong counts result elements that differ from a float64 reference (with -c 1).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"float": torch.float32, "float32": torch.float32, "double": torch.float64,
          "float64": torch.float64, "half": torch.float16, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int": torch.int32,
          "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8}
# "exchange": ranks 2i and 2i+1 send each other `size` bytes at once (isend + irecv): the
# transport's own ceiling, against which the collectives' large-message times can be read.
# "all_reduce_coalesced": --tensors tensors of random sizes (see coalesced_row), one row.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "exchange",
               "all_reduce_coalesced")
OPS = ("sum", "avg", "prod", "min", "max")
GLOO_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


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


def default_iters(nbytes: int) -> int:
    return 200 if nbytes <= 65536 else max(3, (256 << 20) // nbytes)


class Case:
    """Buffers and a run() for one collective at one size, for one library."""

    def __init__(self, lib, comm, coll, nbytes, dtype, op, algo, rank, world):
        self.lib, self.comm, self.coll, self.op, self.algo = lib, comm, coll, op, algo
        self.rank, self.world, self.dtype = rank, world, dtype
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
        else:
            self.inp = self.out = self.input(count)
        self.nbytes = count * elem

    def input(self, n, rank=None):
        """Small integers, exact in every dtype: reductions have one right answer."""
        rank = self.rank if rank is None else rank
        base = torch.arange(n, dtype=torch.float64) % 5 + 1 + (rank % 3)
        return base.to(self.dtype)

    def run(self):
        c, t = self.comm, self.inp
        if self.lib == "ringcomm":
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
            op = GLOO_OPS[self.op]
            if self.coll == "all_reduce":
                dist.all_reduce(t, op=op)
            elif self.coll == "reduce_scatter":
                dist.reduce_scatter_tensor(self.out, t, op=op)
            elif self.coll == "all_gather":
                dist.all_gather_into_tensor(self.out, t)
            elif self.coll == "broadcast":
                dist.broadcast(t, 0)
            elif self.coll == "exchange":
                for w in [dist.irecv(self.out, self.peer), dist.isend(t, self.peer)]:
                    w.wait()
            else:
                dist.reduce(t, 0, op=op)

    def wrong(self) -> int:
        """Runs once on fresh inputs and counts elements that differ from the reference."""
        n_in = self.inp.numel()
        self.inp.copy_(self.input(n_in))
        self.run()
        inputs = [self.input(n_in, r).double() for r in range(self.world)]
        if self.coll == "broadcast":
            expect, got = inputs[0], self.inp
        elif self.coll == "all_gather":
            expect, got = torch.cat(inputs), self.out
        elif self.coll == "exchange":
            expect, got = inputs[self.peer], self.out
        else:
            stacked = torch.stack(inputs)
            red = {"sum": stacked.sum(0), "avg": stacked.mean(0), "prod": stacked.prod(0),
                   "min": stacked.min(0).values, "max": stacked.max(0).values}[self.op]
            if self.coll == "reduce_scatter":
                k = self.out.numel()
                expect, got = red[self.rank * k:(self.rank + 1) * k], self.out
            elif self.coll == "reduce" and self.rank != 0:
                return 0
            else:
                expect, got = red, self.inp
        tol = 1e-2 if self.dtype in (torch.float16, torch.bfloat16) else 1e-6
        ok = torch.isclose(got.double(), expect.to(self.dtype).double(), rtol=tol, atol=tol)
        return int((~ok).sum())


def time_case(case: Case, iters: int, barrier) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    return (time.perf_counter() - start) / iters


def coalesced_row(args, comm, rank: int, world: int, libs) -> dict:
    """--tensors tensors with random sizes in --tensor-bytes (seed --seed), reduced in the same
    run, samples interleaved: ringcomm all_reduce_coalesced, one ringcomm all_reduce per tensor,
    gloo's dist.all_reduce_coalesced (with --compare gloo), and for reference one ringcomm
    all_reduce of a single tensor of the same total size (no packing: the transport's floor for
    these bytes). Ratios: each variant's time over all_reduce_coalesced's."""
    import warnings

    dtype = DTYPES[args.datatype]
    elem = torch.tensor([], dtype=dtype).element_size()
    lo, hi = (parse_size(s) for s in args.tensor_bytes.split("-"))
    gen = torch.Generator().manual_seed(args.seed)
    counts = torch.randint(max(1, lo // elem), hi // elem + 1, (args.tensors,), generator=gen).tolist()

    def inputs(r):  # small integers: every variant has one right answer
        return [(torch.arange(c, dtype=torch.float64) % 5 + 1 + r % 3).to(dtype) for c in counts]

    tensors = inputs(rank)
    flat = torch.cat(tensors)
    variants = {
        "ringcomm all_reduce_coalesced": lambda: comm.all_reduce_coalesced(tensors, op=args.op),
        "ringcomm all_reduce per tensor": lambda: [comm.all_reduce(t, op=args.op) for t in tensors],
    }
    if "gloo" in libs:
        warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*deprecated")
        variants["gloo all_reduce_coalesced"] = lambda: dist.all_reduce_coalesced(
            tensors, op=GLOO_OPS[args.op])
    variants["ringcomm all_reduce, one flat tensor"] = lambda: comm.all_reduce(flat, op=args.op)
    iters = args.iters or 20
    for run in variants.values():
        for _ in range(args.warmup_iters):
            run()
    samples = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
        for name, run in variants.items():
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            samples[name].append((time.perf_counter() - start) / iters)
    stacked = [torch.cat(inputs(r)).double() for r in range(world)]
    expect = {"sum": sum(stacked), "avg": sum(stacked) / world,
              "prod": torch.stack(stacked).prod(0), "min": torch.stack(stacked).min(0).values,
              "max": torch.stack(stacked).max(0).values}[args.op].to(dtype).double()
    wrong = []
    for name, run in variants.items():
        for t, fresh in zip(tensors, inputs(rank)):
            t.copy_(fresh)
        flat.copy_(torch.cat(tensors))
        run()
        got = flat if name.endswith("flat tensor") else torch.cat(tensors)
        wrong.append(int((got.double() != expect).sum()) if args.check else 0)
    wrong_total = torch.tensor(wrong, dtype=torch.int64)
    comm.all_reduce(wrong_total)
    nbytes = sum(counts) * elem
    first = statistics.median(samples["ringcomm all_reduce_coalesced"])
    row = {"coll": args.coll, "ranks": world, "type": args.datatype, "redop": args.op,
           "tensors": args.tensors, "tensor_bytes": args.tensor_bytes, "seed": args.seed,
           "size": nbytes}
    for (name, times), w in zip(samples.items(), wrong_total.tolist()):
        t = statistics.median(times)
        row[name] = {"time_us": t * 1e6, "algbw": nbytes / t / 1e9, "wrong": w,
                     "ratio": t / first, "samples_us": [x * 1e6 for x in times]}
    if rank == 0:
        print(f"# {args.tensors} {args.datatype} tensors of {args.tensor_bytes} B (seed {args.seed}, "
              f"{nbytes} B in all), {world} ranks, op {args.op}, {iters} calls per sample, "
              f"{args.repeats} repeats (median); ratio = time / all_reduce_coalesced's", flush=True)
        print(f"# {'variant':<36} {'time(us)':>10} {'algbw':>7} {'#wrong':>6} {'ratio':>7}")
        for name in variants:
            r = row[name]
            print(f"  {name:<36} {r['time_us']:>10.1f} {r['algbw']:>7.3f} {r['wrong']:>6} "
                  f"{r['ratio']:>7.2f}", flush=True)
    return row


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    import ringcomm

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_store), timeout=timedelta(minutes=5))
    comm = ringcomm.Communicator(dist.PrefixStore("bench", store), rank, world,
                                 timeout=timedelta(minutes=5), name="bench")
    libs = ["ringcomm"]
    if args.compare == "gloo":
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank,
                                world_size=world, timeout=timedelta(minutes=5))
        libs.append("gloo")
    dtype = DTYPES[args.datatype]
    rows = []
    coalesced = args.coll == "all_reduce_coalesced"
    if coalesced:
        rows.append(coalesced_row(args, comm, rank, world, libs))
    elif rank == 0:
        print(f"# ringcomm {args.coll}, {world} ranks, {args.datatype}, op {args.op}, "
              f"algorithm {args.algo}, {args.repeats} repeats (median)", flush=True)
        head = f"# {'size(B)':>12} {'count':>10} {'type':>8} {'redop':>5}"
        for lib in libs:
            head += f" | {lib + ' time(us)':>18} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        if len(libs) > 1:
            head += f" | {'time ratio':>10} {'busbw ratio':>11}"
        print(head, flush=True)
    for nbytes in [] if coalesced else sizes_from(args):
        cases = [Case(lib, comm if lib == "ringcomm" else None, args.coll, nbytes, dtype,
                      args.op, args.algo, rank, world) for lib in libs]
        iters = args.iters or default_iters(cases[0].nbytes)
        for case in cases:
            for _ in range(args.warmup_iters):
                case.run()
        samples = {lib: [] for lib in libs}
        for _ in range(args.repeats):  # interleaved, so drift hits both libraries alike
            for case in cases:
                samples[case.lib].append(time_case(case, iters, comm.barrier))
        row = {"size": cases[0].nbytes, "count": cases[0].count, "type": args.datatype,
               "redop": args.op, "coll": args.coll, "ranks": world}
        for case in cases:
            t = statistics.median(samples[case.lib])
            algbw = case.nbytes / t / 1e9
            wrong = case.wrong() if args.check else 0
            row[case.lib] = {"time_us": t * 1e6, "algbw": algbw,
                             "busbw": algbw * bus_factor(args.coll, world), "wrong": wrong,
                             "samples_us": [s * 1e6 for s in samples[case.lib]]}
        # every rank's #wrong counts
        wrong_total = torch.tensor([row[lib]["wrong"] for lib in libs], dtype=torch.int64)
        comm.all_reduce(wrong_total)
        for i, lib in enumerate(libs):
            row[lib]["wrong"] = int(wrong_total[i])
        rows.append(row)
        if rank == 0:
            line = f"  {row['size']:>12} {row['count']:>10} {args.datatype:>8} {args.op:>5}"
            for lib in libs:
                r = row[lib]
                line += f" | {r['time_us']:>18.1f} {r['algbw']:>7.3f} {r['busbw']:>7.3f} {r['wrong']:>6}"
            if len(libs) > 1:
                rc, gl = row["ringcomm"], row["gloo"]
                line += f" | {rc['time_us'] / gl['time_us']:>10.3f} {rc['busbw'] / gl['busbw']:>11.2f}"
            print(line, flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.compare == "gloo":
        dist.destroy_process_group()
    comm.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv) -> int:
    """Starts --ranks local ranks, each running this module as torchrun would."""
    port = free_port()
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "ringcomm.bench", *argv], env=env))
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringcomm-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20,
                   help="increment between sizes when -f is 1")
    p.add_argument("--sizes", help="comma-separated sizes, instead of -b/-e/-f")
    p.add_argument("-n", "--iters", type=int, default=0,
                   help="operations per sample (default: 200 up to 64 KiB, else 256 MiB / size; "
                        "all_reduce_coalesced: 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong results")
    p.add_argument("-o", "--op", choices=OPS, default="sum")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPES), default="float")
    p.add_argument("--coll", choices=COLLECTIVES, default="all_reduce")
    p.add_argument("--algo", choices=("auto", "ring", "tree", "recursive_doubling"), default="auto")
    p.add_argument("--repeats", type=int, default=5, help="samples per size; the median is shown")
    p.add_argument("--ranks", type=int, default=2, help="local ranks to launch (without torchrun)")
    p.add_argument("--compare", choices=("none", "gloo"), default="none")
    p.add_argument("--json", help="write every row (with all samples) to this file")
    p.add_argument("--tensors", type=int, default=1000,
                   help="all_reduce_coalesced: number of tensors")
    p.add_argument("--tensor-bytes", default="1K-16K",
                   help="all_reduce_coalesced: tensor sizes, uniformly random in MIN-MAX bytes")
    p.add_argument("--seed", type=int, default=0, help="all_reduce_coalesced: seed of the sizes")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.compare == "gloo" and args.op == "avg":
        raise SystemExit("gloo has no avg; compare with --op sum")
    if "RANK" in os.environ:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
