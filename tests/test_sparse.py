"""sparse_all_reduce on 1-5 ranks against a dense reference, for every algorithm."""
import pytest
import torch

from ranks import run_ranks

ALGOS = ["sparse_gather", "sparse_ranges", "ring", "auto"]


def pairs(rank, numel, k, value_dtype, seed):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    idx = torch.randint(0, numel, (k,), generator=gen, dtype=torch.int32) if numel else torch.zeros(0, dtype=torch.int32)
    # small integers: every sum is exact, so all algorithms must agree with the reference exactly
    val = torch.randint(-8, 9, (k,), generator=gen).to(value_dtype)
    return idx, val


def dense_reference(world, numel, ks, value_dtype, seed):
    ref = torch.zeros(numel, dtype=torch.float64)
    for r in range(world):
        idx, val = pairs(r, numel, ks[r], value_dtype, seed)
        ref.index_add_(0, idx.long(), val.double())
    return ref


def sparse_cases(comm):
    n = comm.world_size
    digests = []
    cases = [(1000, [10] * n), (1000, [0] * n), (50_000, [500 * (r + 1) for r in range(n)]),
             (7, [20] * n), (200_000, [2000] * n), (3, [0] + [5] * (n - 1))]
    for seed, (numel, ks) in enumerate(cases):
        for value_dtype in (torch.float32, torch.float16, torch.bfloat16):
            idx, val = pairs(comm.rank, numel, ks[comm.rank], value_dtype, seed)
            ref = dense_reference(n, numel, ks, value_dtype, seed)
            for algo in ALGOS:
                out = comm.sparse_all_reduce(idx, val, numel, algorithm=algo)
                assert out.dtype == torch.float32 and out.numel() == numel
                assert torch.equal(out.double(), ref), (numel, ks, value_dtype, algo)
                avg = comm.sparse_all_reduce(idx, val, numel, op="avg", algorithm=algo,
                                             out=torch.empty(numel, dtype=torch.bfloat16))
                assert torch.allclose(avg.double(), (ref / n).bfloat16().double(), rtol=1e-2, atol=1e-2)
                digests.append(out.sum().item())
    # async form
    idx, val = pairs(comm.rank, 1000, 10, torch.float32, 99)
    work = comm.sparse_all_reduce(idx, val, 1000, async_op=True)
    assert torch.equal(work.get_future().wait().double(), dense_reference(n, 1000, [10] * n, torch.float32, 99))
    return digests


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sparse_all_reduce_matches_dense(world):
    results = run_ranks(world, sparse_cases, timeout=120)
    assert all(r == results[0] for r in results)


def float_sums_identical(comm):
    gen = torch.Generator().manual_seed(comm.rank)
    idx = torch.randint(0, 100_000, (3000,), generator=gen, dtype=torch.int32)
    val = torch.randn(3000, generator=gen)
    outs = [comm.sparse_all_reduce(idx, val, 100_000, algorithm=a) for a in ("sparse_gather", "sparse_ranges")]
    return [o.numpy().tobytes() for o in outs]


def test_gather_and_ranges_give_identical_bits_on_every_rank():
    results = run_ranks(3, float_sums_identical)
    flat = {b for r in results for b in r}
    assert len(flat) == 1


def bad_sparse_input(comm):
    import pytest as pt
    with pt.raises(ValueError, match="outside"):
        comm.sparse_all_reduce(torch.tensor([5], dtype=torch.int32), torch.ones(1), 5)
    with pt.raises(TypeError, match="int32"):
        comm.sparse_all_reduce(torch.tensor([1]), torch.ones(1), 5)
    with pt.raises(ValueError, match="values"):
        comm.sparse_all_reduce(torch.tensor([1], dtype=torch.int32), torch.ones(2), 5)
    with pt.raises(ValueError, match="float32, float16 and bfloat16"):
        comm.sparse_all_reduce(torch.tensor([1], dtype=torch.int32), torch.ones(1, dtype=torch.float64), 5)
    with pt.raises(ValueError, match="algorithm"):
        comm.sparse_all_reduce(torch.tensor([1], dtype=torch.int32), torch.ones(1), 5, algorithm="tree")
    out = comm.sparse_all_reduce(torch.tensor([1], dtype=torch.int32), torch.ones(1), 5)
    return out.tolist()


def test_bad_sparse_input_is_rejected_before_sending():
    assert run_ranks(2, bad_sparse_input) == [[0.0, 2.0, 0.0, 0.0, 0.0]] * 2
