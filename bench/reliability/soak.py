"""Soak test: local ranks run thousands of random collectives, each result checked bitwise, while
every rank's memory (VmRSS) and open file descriptors are watched for leaks.

    .venv/bin/python bench/reliability/soak.py                       # 4 ranks, 10,000 steps
    .venv/bin/python bench/reliability/soak.py --steps 300 --transport tcp
    .venv/bin/python bench/reliability/soak.py --ranks 6 --hosts 3    # shm inside, tcp across

Every rank draws the same calls from one seeded RNG: the collective (all_reduce under each
algorithm, reduce_scatter, all_gather(v), broadcast, reduce, gather, scatter, all_to_all, barrier,
the coalesced ones), its dtype, op, root and sizes (0 to --max-mib per buffer, log-uniform: as
many calls per octave, so most are small), and whether it runs with async_op=True, to be waited
one to six steps later (up to 8 in flight). Inputs are small integers, so every op has exactly one
right answer in every dtype (float avg too: one rounding of the true quotient), which each rank
computes locally and compares bit for bit. VmRSS and the fd count are sampled every
--sample-every steps, with nothing in flight; growth is counted from the sample at --warmup (a
fraction of the steps), after the allocator and the transports have reached their working size
(RSS climbs some 20 MB over the first few hundred steps: a run that short is mostly warm-up;
after it, samples of a healthy run stay within a few MB). The times shown are rank 0's, call to return of blocking calls: they include waiting
for async calls queued ahead and for peers still checking earlier results, so they point at
stalls rather than measure speed (ringcomm.bench does that).

Exit status: 0 if every result was right, no rank's RSS grew by --max-rss-growth MB or more and
no rank's fd count changed by more than --max-fd-growth; 1 otherwise; 2 if a rank failed or hung
(past --deadline).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from harness import TRANSPORTS, connect, rank_env

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
]
FLOAT_OPS = ["sum", "sum", "avg", "prod", "min", "max"]  # sum twice: the op that matters most
INT_OPS = FLOAT_OPS + ["band", "bor", "bxor"]
BOOL_OPS = [op for op in INT_OPS if op != "avg"]  # avg is undefined on bool
BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
EXACT = {
    "sum": torch.add,
    "avg": torch.add,
    "prod": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
}
ALGORITHMS = ["auto", "ring", "tree", "recursive_doubling"]
BUCKET_BYTES = [4 << 10, 64 << 10, 1 << 20, 25 << 20]
# Collective -> weight in the mix.
KINDS = {
    "all_reduce": 6,
    "reduce_scatter": 2,
    "all_gather": 2,
    "all_gatherv": 1,
    "broadcast": 2,
    "reduce": 2,
    "gather": 1,
    "scatter": 1,
    "all_to_all": 1,
    "barrier": 1,
    "all_reduce_coalesced": 1,
    "broadcast_coalesced": 1,
    "all_gather_coalesced": 1,
}
ASYNC_SHARE = 0.25
MAX_IN_FLIGHT = 8
# Same-size integer views: torch.equal on floats would call -0.0 and 0.0 equal.
BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
LIBC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
MAX_RANKS = 15  # float16 products of up to 15 twos are exact; sums (<= 4 per rank) are too


def raw(rank, n, salt, op, start=0):
    """Rank `rank`'s input values (int32) at positions start..start+n: below 5 (below 3 for prod:
    products of 0, 1 and 2 are 0 or powers of two), so results are exact in every dtype."""
    mod = 3 if op == "prod" else 5
    return (torch.arange(start, start + n, dtype=torch.int32) * 7 + rank * 3 + salt) % mod


def fill(rank, n, dtype, salt, op="sum", start=0):
    return raw(rank, n, salt, op, start).to(dtype)


def reduced(op, inputs, dtype, n):
    """The one right result of reducing the ranks' `inputs` (raw int32 values) with `op` in dtype."""
    if op in BITWISE:  # on the values as cast: 1 & 2 is 0 in int8 but True & True in bool
        return functools.reduce(BITWISE[op], [x.to(dtype) for x in inputs])
    exact = functools.reduce(EXACT[op], inputs)  # no rounding, no overflow in int32
    if op != "avg":
        return exact.to(dtype)  # integer sums wrap around, bool sums are or, as the core's
    if dtype.is_floating_point:  # the exact sum / n, rounded once; the core's float32 division
        return (exact.double() / n).to(dtype)  # before float16 or bfloat16 gives the same bits
    return torch.div(exact.to(dtype).long(), n, rounding_mode="trunc").to(dtype)  # NCCL's


def same(got, want) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    bits = BITS.get(got.dtype, got.dtype)
    return torch.equal(got.view(bits), want.view(bits))


def draw_bytes(rng, max_bytes) -> int:
    """0 (one call in 20), else log-uniform in 1 .. max_bytes."""
    return 0 if rng.random() < 0.05 else int(2 ** rng.uniform(0, math.log2(max_bytes)))


def rss_and_fds():
    """VmRSS (MB) and open fds, of what is live: garbage is collected and the C heap's free pages
    returned first (see also soak_env)."""
    gc.collect()
    if LIBC_TRIM is not None:
        LIBC_TRIM(0)
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir("/proc/self/fd"))


class Soak:
    """One rank's random collectives. Each method issues one (drawing its arguments from the
    shared RNG, so every rank issues the same call) and returns (work or None, a description,
    a check that says whether this rank's results are bitwise right)."""

    def __init__(self, comm, seed: int, max_bytes: int):
        self.comm, self.r, self.n = comm, comm.rank, comm.world_size
        self.rng = random.Random(seed)
        self.max_bytes = max_bytes

    def count(self, dtype, parts=1) -> int:
        """Elements per part, for `parts` parts of one buffer of at most max_bytes."""
        return draw_bytes(self.rng, self.max_bytes) // (dtype.itemsize * parts)

    def dtype_and_op(self):
        dtype = self.rng.choice(DTYPES)
        ops = FLOAT_OPS if dtype.is_floating_point else BOOL_OPS if dtype == torch.bool else INT_OPS
        return dtype, self.rng.choice(ops)

    def expect(self, op, count, dtype, salt, start=0):
        return reduced(op, [raw(q, count, salt, op, start) for q in range(self.n)], dtype, self.n)

    def all_reduce(self, salt, async_op):
        dtype, op = self.dtype_and_op()
        count, algo = self.count(dtype), self.rng.choice(ALGORITHMS)
        t = fill(self.r, count, dtype, salt, op)
        work = self.comm.all_reduce(t, op=op, algorithm=algo, async_op=async_op)
        return (
            work,
            f"{dtype} x{count} op={op} {algo}",
            lambda: same(t, self.expect(op, count, dtype, salt)),
        )

    def reduce_scatter(self, salt, async_op):
        dtype, op = self.dtype_and_op()
        count, as_list = self.count(dtype, self.n), self.rng.random() < 0.3
        inp = fill(self.r, count * self.n, dtype, salt, op)
        out = torch.empty(count, dtype=dtype)
        work = self.comm.reduce_scatter(
            out, list(inp.view(self.n, count)) if as_list else inp, op=op, async_op=async_op
        )
        return (
            work,
            f"{dtype} x{count} op={op} list={as_list}",
            lambda: same(out, self.expect(op, count, dtype, salt, self.r * count)),
        )

    def all_gather(self, salt, async_op):
        dtype = self.rng.choice(DTYPES)
        count, as_list = self.count(dtype, self.n), self.rng.random() < 0.3
        out = (
            [torch.empty(count, dtype=dtype) for _ in range(self.n)]
            if as_list
            else torch.empty(count * self.n, dtype=dtype)
        )
        work = self.comm.all_gather(out, fill(self.r, count, dtype, salt), async_op=async_op)

        def check():
            want = [fill(q, count, dtype, salt) for q in range(self.n)]
            return all(map(same, out, want)) if as_list else same(out, torch.cat(want))

        return work, f"{dtype} x{count} list={as_list}", check

    def all_gatherv(self, salt, async_op):
        dtype = self.rng.choice(DTYPES)
        counts = [self.count(dtype, self.n) for _ in range(self.n)]
        out = torch.empty(sum(counts), dtype=dtype)
        work = self.comm.all_gatherv(
            out, fill(self.r, counts[self.r], dtype, salt), counts, async_op=async_op
        )
        return (
            work,
            f"{dtype} counts={counts}",
            lambda: same(out, torch.cat([fill(q, c, dtype, salt) for q, c in enumerate(counts)])),
        )

    def broadcast(self, salt, async_op):
        dtype = self.rng.choice(DTYPES)
        count, root = self.count(dtype), self.rng.randrange(self.n)
        t = fill(self.r, count, dtype, salt)
        work = self.comm.broadcast(t, root, async_op=async_op)
        return (
            work,
            f"{dtype} x{count} root={root}",
            lambda: same(t, fill(root, count, dtype, salt)),
        )

    def reduce(self, salt, async_op):
        dtype, op = self.dtype_and_op()
        count, root = self.count(dtype), self.rng.randrange(self.n)
        t = fill(self.r, count, dtype, salt, op)
        work = self.comm.reduce(t, root, op=op, async_op=async_op)
        # Off the root the input must come back untouched.
        return (
            work,
            f"{dtype} x{count} op={op} root={root}",
            lambda: same(
                t,
                self.expect(op, count, dtype, salt)
                if self.r == root
                else fill(self.r, count, dtype, salt, op),
            ),
        )

    def gather(self, salt, async_op):
        dtype = self.rng.choice(DTYPES)
        count, root = self.count(dtype, self.n), self.rng.randrange(self.n)
        outs = [torch.empty(count, dtype=dtype) for _ in range(self.n)] if self.r == root else None
        work = self.comm.gather(fill(self.r, count, dtype, salt), outs, root, async_op=async_op)
        return (
            work,
            f"{dtype} x{count} root={root}",
            lambda: (
                self.r != root
                or all(same(t, fill(q, count, dtype, salt)) for q, t in enumerate(outs))
            ),
        )

    def scatter(self, salt, async_op):
        dtype = self.rng.choice(DTYPES)
        count, root = self.count(dtype, self.n), self.rng.randrange(self.n)
        ins = (
            [fill(root, count, dtype, salt + q) for q in range(self.n)] if self.r == root else None
        )
        out = torch.empty(count, dtype=dtype)
        work = self.comm.scatter(ins, out, root, async_op=async_op)
        return (
            work,
            f"{dtype} x{count} root={root}",
            lambda: same(out, fill(root, count, dtype, salt + self.r)),
        )

    def all_to_all(self, salt, async_op):
        """Uneven blocks: sizes[q][p] elements go from rank q to rank p."""
        dtype = self.rng.choice(DTYPES)
        sizes = [[self.count(dtype, self.n) for _ in range(self.n)] for _ in range(self.n)]
        r = self.r
        ins = [fill(r, sizes[r][p], dtype, salt + p) for p in range(self.n)]
        outs = [torch.empty(sizes[q][r], dtype=dtype) for q in range(self.n)]
        work = self.comm.all_to_all(outs, ins, async_op=async_op)
        return (
            work,
            f"{dtype} sizes={sizes}",
            lambda: all(same(t, fill(q, sizes[q][r], dtype, salt + r)) for q, t in enumerate(outs)),
        )

    def barrier(self, salt, async_op):
        return self.comm.barrier(async_op=async_op), "", lambda: True

    def tensor_list(self, dtypes):
        """1 to 12 tensors of dtypes drawn from `dtypes`, at most max_bytes in all."""
        k = self.rng.randint(1, 12)
        picked = [self.rng.choice(dtypes) for _ in range(k)]
        return picked, [self.count(d, k) for d in picked]

    def all_reduce_coalesced(self, salt, async_op):
        op = self.rng.choice(INT_OPS)
        allowed = (
            DTYPES[:4]
            if op == "avg"
            else [d for d in DTYPES if not d.is_floating_point]
            if op in BITWISE
            else DTYPES
        )
        dtypes, counts = self.tensor_list(allowed)
        bucket = self.rng.choice(BUCKET_BYTES)
        ts = [fill(self.r, c, d, salt + i, op) for i, (d, c) in enumerate(zip(dtypes, counts))]
        work = self.comm.all_reduce_coalesced(ts, op=op, bucket_bytes=bucket, async_op=async_op)
        return (
            work,
            f"op={op} bucket={bucket} {list(zip(dtypes, counts))}",
            lambda: all(
                same(t, self.expect(op, c, d, salt + i))
                for i, (t, d, c) in enumerate(zip(ts, dtypes, counts))
            ),
        )

    def broadcast_coalesced(self, salt, async_op):
        dtypes, counts = self.tensor_list(DTYPES)
        root, bucket = self.rng.randrange(self.n), self.rng.choice(BUCKET_BYTES)
        ts = [fill(self.r, c, d, salt + i) for i, (d, c) in enumerate(zip(dtypes, counts))]
        work = self.comm.broadcast_coalesced(ts, root, bucket_bytes=bucket, async_op=async_op)
        return (
            work,
            f"root={root} bucket={bucket} {list(zip(dtypes, counts))}",
            lambda: all(
                same(t, fill(root, c, d, salt + i))
                for i, (t, d, c) in enumerate(zip(ts, dtypes, counts))
            ),
        )

    def all_gather_coalesced(self, salt, async_op):
        dtypes, counts = self.tensor_list(DTYPES)
        bucket = self.rng.choice(BUCKET_BYTES)
        ins = [fill(self.r, c, d, salt + i) for i, (d, c) in enumerate(zip(dtypes, counts))]
        outs = [[torch.empty(c, dtype=d) for d, c in zip(dtypes, counts)] for _ in range(self.n)]
        work = self.comm.all_gather_coalesced(outs, ins, bucket_bytes=bucket, async_op=async_op)
        return (
            work,
            f"bucket={bucket} {list(zip(dtypes, counts))}",
            lambda: all(
                same(t, fill(q, c, d, salt + i))
                for q in range(self.n)
                for i, (t, d, c) in enumerate(zip(outs[q], dtypes, counts))
            ),
        )


def rank_main(args) -> None:
    """One rank: runs the steps and writes its counts and samples to workdir/rank<r>.json."""
    r, n = args.rank, args.ranks
    _, comm = connect(args.workdir, r, n, args.timeout, "soak")
    soak = Soak(comm, args.seed, int(args.max_mib * (1 << 20)))
    kinds, weights = list(KINDS), list(KINDS.values())
    warmup = max(1, round(args.steps * args.warmup))
    sample_at = {0, warmup, *range(args.sample_every, args.steps, args.sample_every)}
    ops = {
        kind: {"calls": 0, "async": 0, "blocking_s": 0.0, "max_ms": 0.0, "slowest": ""}
        for kind in KINDS
    }
    wrong, errors, samples, pending = 0, [], [], []

    def verify(step, kind, desc, check):
        nonlocal wrong
        if not check():
            wrong += 1
            if len(errors) < 20:
                errors.append(f"rank {r} step {step}: {kind} {desc}")

    def settle(due_by):
        """Waits for the async calls due by step `due_by`, and the oldest beyond MAX_IN_FLIGHT."""
        nonlocal pending
        keep, overflow = [], len(pending) - MAX_IN_FLIGHT
        for i, entry in enumerate(pending):
            due, step, kind, desc, work, check = entry
            if due <= due_by or i < overflow:
                work.wait()
                verify(step, kind, desc, check)
            else:
                keep.append(entry)
        pending = keep

    for step in range(args.steps):
        if step in sample_at:
            settle(args.steps)
            samples.append((step, *rss_and_fds()))
        kind = soak.rng.choices(kinds, weights)[0]
        async_op = soak.rng.random() < ASYNC_SHARE
        issued = time.perf_counter()
        work, desc, check = getattr(soak, kind)(step, async_op)
        stats = ops[kind]
        stats["calls"] += 1
        if async_op:
            stats["async"] += 1
            pending.append((step + soak.rng.randint(1, 6), step, kind, desc, work, check))
        else:
            took = time.perf_counter() - issued  # with its inputs' fill, and async calls ahead
            stats["blocking_s"] += took
            if took * 1e3 > stats["max_ms"]:
                stats["max_ms"], stats["slowest"] = took * 1e3, f"step {step}: {desc}"
            verify(step, kind, desc, check)
        del work, check  # else this step's buffers would still be alive at the next sample
        settle(step)
    settle(args.steps)
    comm.barrier()  # no rank closes its connections while a peer still works
    samples.append((args.steps, *rss_and_fds()))
    transports = comm.transports
    comm.close()
    with open(os.path.join(args.workdir, f"rank{r}.json"), "w") as f:
        json.dump(
            {
                "rank": r,
                "wrong": wrong,
                "errors": errors,
                "ops": ops,
                "samples": samples,
                "warmup_step": warmup,
                "transports": transports,
            },
            f,
        )


def soak_env(args, r) -> dict:
    env = dict(os.environ, **rank_env(args.transport, r, args.ranks, args.hosts))
    env["OMP_NUM_THREADS"] = "1"  # one torch thread per rank: --ranks processes share the cores
    # glibc's initial mmap threshold, pinned: buffers from 128 KiB are mapped and unmapped on their
    # own. By default freeing one raises the threshold, later buffers of a few MB come from the
    # heap, and its fragmentation swings RSS by +-5 MB between samples, malloc_trim or not (and by
    # +-40 MB without it).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    return env


def exits(procs) -> str:
    return ", ".join(
        f"killed by {signal.Signals(-p.returncode).name}"
        if p.returncode < 0
        else f"exit code {p.returncode}, traceback above"
        for p in procs
    )


def launch(args, argv) -> int:
    """Starts the ranks (this script again, with --rank), waits for them within --deadline, then
    prints the summary. Returns the exit status."""
    workdir = tempfile.mkdtemp(prefix="ringcomm-soak-")
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                *argv,
                "--rank",
                str(r),
                "--workdir",
                workdir,
            ],
            env=soak_env(args, r),
        )
        for r in range(args.ranks)
    ]
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                print(
                    f"soak: rank(s) {failed} failed ({exits(procs[r] for r in failed)}): "
                    "stopping the rest",
                    file=sys.stderr,
                )
                return 2
            if time.monotonic() - start > args.deadline:
                hung = [r for r, p in enumerate(procs) if p.poll() is None]
                print(
                    f"soak: rank(s) {hung} still running after --deadline {args.deadline:.0f} s "
                    "(a hang?): killed",
                    file=sys.stderr,
                )
                return 2
            time.sleep(0.2)
        wall = time.monotonic() - start
        if any(p.returncode for p in procs):
            print(f"soak: ranks failed ({exits(procs)})", file=sys.stderr)
            return 2
        results = []
        for r in range(args.ranks):
            with open(os.path.join(workdir, f"rank{r}.json")) as f:
                results.append(json.load(f))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(args, results, wall)


def summarize(args, results, wall) -> int:
    per_rank = []
    for res in results:
        by_step = {s[0]: s for s in res["samples"]}
        _, rss0, fds0 = by_step[res["warmup_step"]]
        _, rss1, fds1 = by_step[args.steps]
        per_rank.append(
            {
                "rank": res["rank"],
                "wrong": res["wrong"],
                "rss_warm_mb": rss0,
                "rss_end_mb": rss1,
                "rss_growth_mb": rss1 - rss0,
                "fds_warm": fds0,
                "fds_end": fds1,
                "fd_growth": fds1 - fds0,
                "samples": res["samples"],
            }
        )
    wrong = sum(p["wrong"] for p in per_rank)
    rss_growth = max(p["rss_growth_mb"] for p in per_rank)
    fd_growth = max((p["fd_growth"] for p in per_rank), key=abs)
    failures = []
    if wrong:
        failures.append(f"{wrong} wrong results")
    if rss_growth >= args.max_rss_growth:
        failures.append(f"RSS grew {rss_growth:.1f} MB (limit: under {args.max_rss_growth:g})")
    if abs(fd_growth) > args.max_fd_growth:
        failures.append(f"fd count changed by {fd_growth} (limit: {args.max_fd_growth})")
    ops = results[0]["ops"]  # every rank issues the same calls; times are rank 0's
    warm = results[0]["warmup_step"]

    print(
        f"# soak: {args.ranks} ranks, {args.steps} steps, seed {args.seed}, transport "
        f"{args.transport}{f', {args.hosts} hosts' if args.hosts else ''}, buffers up to "
        f"{args.max_mib:g} MiB; wall {wall:.1f} s"
    )
    for res in results:  # what --transport and --hosts gave: each rank's transport to each peer
        print(f"# rank {res['rank']} to ranks 0..{args.ranks - 1}: {' '.join(res['transports'])}")
    print(
        f"# {'collective':<22} {'calls':>6} {'async':>6} {'mean ms':>8} {'max ms':>8}  "
        "slowest (blocking calls)"
    )
    for kind, o in ops.items():
        blocking = o["calls"] - o["async"]
        mean = o["blocking_s"] * 1e3 / blocking if blocking else 0.0
        print(
            f"  {kind:<22} {o['calls']:>6} {o['async']:>6} {mean:>8.2f} {o['max_ms']:>8.1f}  "
            f"{o['slowest'][:70]}"
        )
    print(
        f"# {'rank':>4} {'wrong':>6} {f'RSS@{warm} MB':>12} {'RSS@end MB':>11} {'growth':>7} "
        f"{f'fds@{warm}':>9} {'fds@end':>8} {'growth':>7}"
    )
    for p in per_rank:
        print(
            f"  {p['rank']:>4} {p['wrong']:>6} {p['rss_warm_mb']:>12.1f} {p['rss_end_mb']:>11.1f} "
            f"{p['rss_growth_mb']:>7.1f} {p['fds_warm']:>9} {p['fds_end']:>8} {p['fd_growth']:>7}"
        )
    errors = [e for res in results for e in res["errors"]]
    for line in errors[:10]:
        print(f"  wrong: {line[:200]}")
    print(
        f"steps {args.steps}  wrong {wrong}  RSS growth {rss_growth:.1f} MB  fd growth "
        f"{fd_growth}  wall {wall:.1f} s  "
        f"{'FAIL: ' + '; '.join(failures) if failures else 'PASS'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ranks": args.ranks,
                    "steps": args.steps,
                    "seed": args.seed,
                    "transport": args.transport,
                    "hosts": args.hosts,
                    "max_mib": args.max_mib,
                    "warmup_step": warm,
                    "wrong": wrong,
                    "errors": errors,
                    "rss_growth_mb": rss_growth,
                    "fd_growth": fd_growth,
                    "wall_s": wall,
                    "passed": not failures,
                    "failures": failures,
                    "ops": ops,
                    "transports": [res["transports"] for res in results],
                    "per_rank": per_rank,
                },
                f,
                indent=1,
            )
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--max-mib",
        type=float,
        default=4,
        help="largest buffer of one call, MiB; sizes are log-uniform below it",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="sets RINGCOMM_TRANSPORT in every rank (mixed: auto, two ranks per fake host)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="fake this many hosts (RINGCOMM_HOST_ID): shm inside one, tcp between",
    )
    p.add_argument("--sample-every", type=int, default=500, help="steps between RSS/fd samples")
    p.add_argument(
        "--warmup",
        type=float,
        default=0.05,
        help="fraction of the steps after which RSS and fd growth count",
    )
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=10.0,
        help="fail if a rank's RSS grows by this many MB or more after warm-up",
    )
    p.add_argument(
        "--max-fd-growth",
        type=int,
        default=0,
        help="fail if a rank's open fd count changes by more after warm-up",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="the communicators' timeout (s): a stuck collective fails its rank",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=1800,
        help="seconds before the whole run is killed as hung",
    )
    p.add_argument("--json", help="write the summary, with every sample, to this file")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set by launch() in each rank
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not 2 <= args.ranks <= MAX_RANKS:
        raise SystemExit(
            f"--ranks must be 2..{MAX_RANKS}: beyond, float16 references stop being exact"
        )
    if not 0 <= args.hosts <= args.ranks:
        raise SystemExit("--hosts must be 0 (not faked) up to --ranks")
    if args.rank is not None:
        rank_main(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
