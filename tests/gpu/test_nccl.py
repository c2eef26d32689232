"""ringcomm's all-reduce over NCCL (ringcomm/nccl.py): its schedules with NCCL as the wire and
its kernels reducing, and NCCL's own all-reduce, on real ranks (one process per GPU), against the
sum computed on the host from the same inputs."""

import pytest
import torch
import torch.multiprocessing as mp

from ranks import free_port

ALGORITHMS = ["ring", "tree", "recursive_doubling", "nccl", "auto"]
CASES = [  # dtype, op, element counts
    (torch.float32, "sum", [0, 1, 7, 1000, (1 << 20) + 3]),
    (torch.float32, "avg", [5, 100_003]),
    (torch.bfloat16, "sum", [4097]),
    (torch.int64, "max", [33, 70_000]),
    (torch.int32, "sum", [1 << 18]),
]


def contribution(rank, n, dtype):
    # Integers small enough that every sum, in any order, is exact in every dtype.
    gen = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def expected(world, n, dtype, op):
    stack = torch.stack([contribution(r, n, dtype).double() for r in range(world)])
    if op == "sum":
        out = stack.sum(0)
    elif op == "avg":
        out = stack.sum(0) / world
    else:
        out = stack.max(0).values
    return out.to(dtype)


def rank_main(rank, world, port, errors):
    try:
        from ringcomm.nccl import NcclCommunicator

        torch.cuda.set_device(rank)
        store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0)
        comm = NcclCommunicator(store, rank, world)
        for algorithm in ALGORITHMS:
            for dtype, op, counts in CASES:
                for n in counts:
                    t = contribution(rank, n, dtype).cuda()
                    comm.all_reduce(t, op, algorithm)
                    comm.synchronize()
                    want = expected(world, n, dtype, op)
                    got = t.cpu()
                    if dtype.is_floating_point and op == "avg":
                        ok = torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-6)
                    else:
                        ok = torch.equal(got, want)
                    if not ok:
                        raise AssertionError(f"{algorithm} {dtype} {op} n={n}: wrong result")
        # all_gather: every rank's block in rank order.
        mine = torch.full((5,), float(rank), device="cuda")
        out = torch.empty(5 * world, device="cuda")
        comm.all_gather(out, mine)
        assert out.cpu().tolist() == [float(r) for r in range(world) for _ in range(5)]
        # coalesced: tensors of several sizes, each reduced in place.
        tensors = [contribution(rank, n, torch.float32).cuda() for n in (1, 33, 4096)]
        comm.all_reduce_coalesced(tensors)
        for t, n in zip(tensors, (1, 33, 4096)):
            assert torch.equal(t.cpu(), expected(world, n, torch.float32, "sum"))
        # sparse: rank r sends r + 1 pairs (different counts), some positions shared.
        k = rank + 1
        indices = torch.arange(k, dtype=torch.int32, device="cuda") * 3
        vals = torch.full((k,), 1.0 + rank, device="cuda")
        dense = comm.sparse_all_reduce(indices, vals, 64, op="avg")
        want = torch.zeros(64)
        for r in range(world):
            want[torch.arange(r + 1) * 3] += 1.0 + r
        assert torch.allclose(dense.cpu(), want / world)
        comm.synchronize()
        comm.close()
    except BaseException as e:  # reported to the parent, which fails the test with it
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def run_ranks(world, timeout=300):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not alive, f"ranks still running after {timeout} s: {messages}"
    assert not messages and all(p.exitcode == 0 for p in procs), messages


def test_one_rank():
    run_ranks(1)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ranks_one_gpu_each(world):
    if torch.cuda.device_count() < world:
        pytest.skip(
            f"NCCL takes one GPU per rank; {world} ranks need {world} GPUs, this machine "
            f"has {torch.cuda.device_count()}"
        )
    run_ranks(world)


def test_unknown_algorithm_is_refused():
    from ringcomm.nccl import NcclCommunicator

    store = torch.distributed.HashStore()
    comm = NcclCommunicator(store, 0, 1)
    with pytest.raises(ValueError, match="unknown algorithm"):
        comm.all_reduce(torch.ones(4, device="cuda"), algorithm="butterfly")
    with pytest.raises(ValueError, match="CUDA tensor"):
        comm.all_reduce(torch.ones(4))
    comm.close()
