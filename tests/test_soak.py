"""4 ranks run a few hundred random collectives (same seeded sequence on every rank)."""
import random

import torch

from ranks import run_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]


def fill(rank, n, dtype, salt):
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 5).to(dtype)


def soak(comm, steps):
    rng = random.Random(1234)  # identical on every rank: the same sequence of calls
    r, n = comm.rank, comm.world_size
    pending = []
    for step in range(steps):
        kind = rng.choice(["all_reduce", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
                           "reduce", "barrier", "async_all_reduce"])
        count = rng.choice([0, 1, 3, 100, 1000, 5000, 70_000, 300_000])
        dtype = rng.choice(DTYPES)
        root = rng.randrange(n)
        if kind in ("all_reduce", "async_all_reduce"):
            op = rng.choice(["sum", "max", "min"])
            t = fill(r, count, dtype, step)
            inputs = torch.stack([fill(q, count, dtype, step).double() for q in range(n)])
            expect = {"sum": inputs.sum(0), "max": inputs.max(0).values, "min": inputs.min(0).values}[op]
            if kind == "all_reduce":
                comm.all_reduce(t, op=op, algorithm=rng.choice(["auto", "ring", "tree"]))
                assert torch.equal(t.double(), expect), (step, kind)
            else:
                pending.append((comm.all_reduce(t, op=op, async_op=True), t, expect, step))
        elif kind == "reduce_scatter":
            out = torch.empty(count, dtype=dtype)
            comm.reduce_scatter(out, fill(r, count * n, dtype, step))
            total = sum(fill(q, count * n, dtype, step).double() for q in range(n))
            assert torch.equal(out.double(), total[r * count:(r + 1) * count]), (step, kind)
        elif kind == "all_gather":
            out = torch.empty(count * n, dtype=dtype)
            comm.all_gather(out, fill(r, count, dtype, step))
            assert torch.equal(out, torch.cat([fill(q, count, dtype, step) for q in range(n)])), step
        elif kind == "broadcast":
            t = fill(r, count, dtype, step)
            comm.broadcast(t, root)
            assert torch.equal(t, fill(root, count, dtype, step)), (step, kind)
        elif kind == "reduce":
            t = fill(r, count, dtype, step)
            comm.reduce(t, root)
            if r == root:
                expect = sum(fill(q, count, dtype, step).double() for q in range(n))
                assert torch.equal(t.double(), expect), (step, kind)
        else:
            comm.barrier()
        if len(pending) > 4 or step == steps - 1:
            for work, t, expect, s in pending:
                work.wait()
                assert torch.equal(t.double(), expect), (s, "async")
            pending = []
    return steps


def test_soak_four_ranks():
    assert run_ranks(4, soak, 300, timeout=300, comm_timeout=60) == [300] * 4
