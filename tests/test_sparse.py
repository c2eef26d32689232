"""sparse_all_reduce on 1-5 ranks against a dense reference, for every algorithm."""

import pytest
import torch

from ranks import run_ranks

pytestmark = pytest.mark.every_transport  # once per transport (conftest.py)

ALGOS = ["sparse_gather", "sparse_ranges", "ring", "auto"]


def pairs(rank, numel, k, value_dtype, seed):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    idx = (
        torch.randint(0, numel, (k,), generator=gen, dtype=torch.int32)
        if numel
        else torch.zeros(0, dtype=torch.int32)
    )
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
    cases = [
        (1000, [10] * n),
        (1000, [0] * n),
        (50_000, [500 * (r + 1) for r in range(n)]),
        (7, [20] * n),
        (200_000, [2000] * n),
        (3, [0] + [5] * (n - 1)),
    ]
    for seed, (numel, ks) in enumerate(cases):
        for value_dtype in (torch.float32, torch.float16, torch.bfloat16):
            idx, val = pairs(comm.rank, numel, ks[comm.rank], value_dtype, seed)
            ref = dense_reference(n, numel, ks, value_dtype, seed)
            for algo in ALGOS:
                out = comm.sparse_all_reduce(idx, val, numel, algorithm=algo)
                assert out.dtype == torch.float32 and out.numel() == numel
                assert torch.equal(out.double(), ref), (numel, ks, value_dtype, algo)
                avg = comm.sparse_all_reduce(
                    idx,
                    val,
                    numel,
                    op="avg",
                    algorithm=algo,
                    out=torch.empty(numel, dtype=torch.bfloat16),
                )
                assert torch.allclose(
                    avg.double(), (ref / n).bfloat16().double(), rtol=1e-2, atol=1e-2
                )
                digests.append(out.sum().item())
    # async form
    idx, val = pairs(comm.rank, 1000, 10, torch.float32, 99)
    work = comm.sparse_all_reduce(idx, val, 1000, async_op=True)
    assert torch.equal(
        work.get_future().wait().double(), dense_reference(n, 1000, [10] * n, torch.float32, 99)
    )
    return digests


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sparse_all_reduce_matches_dense(world):
    results = run_ranks(world, sparse_cases, timeout=120)
    assert all(r == results[0] for r in results)


def estimates_that_disagree(comm):
    """Each rank sends its pairs with its sizes where its own estimate (every rank's sizes taken
    to be its own) picks gather; the choice made with every rank's sizes may differ."""
    n = comm.world_size
    cases = [
        (200_000, [200_000, 100, 100, 100]),  # ranks 1-3 sent theirs; the choice is not gather
        (200_000, [60_000, 60_000, 100, 100]),  # ranks 0-1 did not; the choice is gather
        (200_000, [100_000, 2000, 2000, 2000]),
    ]  # rank 0 did not; the choice is gather
    for seed, (numel, ks) in enumerate(cases):
        idx, val = pairs(comm.rank, numel, ks[comm.rank], torch.float32, seed)
        out = comm.sparse_all_reduce(idx, val, numel)
        assert torch.equal(out.double(), dense_reference(n, numel, ks, torch.float32, seed)), ks
        # the next operation's messages are not taken for pairs sent ahead
        after = torch.full((3,), float(comm.rank))
        comm.all_reduce(after)
        assert after.tolist() == [6.0] * 3


def test_pairs_sent_ahead_of_the_choice_whatever_it_is():
    run_ranks(4, estimates_that_disagree, timeout=120)


def float_sums_identical(comm):
    gen = torch.Generator().manual_seed(comm.rank)
    idx = torch.randint(0, 100_000, (3000,), generator=gen, dtype=torch.int32)
    val = torch.randn(3000, generator=gen)
    outs = [
        comm.sparse_all_reduce(idx, val, 100_000, algorithm=a)
        for a in ("sparse_gather", "sparse_ranges")
    ]
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
        comm.sparse_all_reduce(
            torch.tensor([1], dtype=torch.int32), torch.ones(1, dtype=torch.float64), 5
        )
    with pt.raises(ValueError, match="algorithm"):
        comm.sparse_all_reduce(
            torch.tensor([1], dtype=torch.int32), torch.ones(1), 5, algorithm="tree"
        )
    out = comm.sparse_all_reduce(torch.tensor([1], dtype=torch.int32), torch.ones(1), 5)
    return out.tolist()


def test_bad_sparse_input_is_rejected_before_sending():
    assert run_ranks(2, bad_sparse_input) == [[0.0, 2.0, 0.0, 0.0, 0.0]] * 2


def ordered_and_shuffled_pairs(comm):
    """The gather decode's two ways (ascending indices, as top-k sends them: `out` built chunk by
    chunk; any other order: scatter-add over all of it) on float values, whose sums depend on the
    order of the additions."""
    n, results = comm.world_size, []
    # 300k positions: several of the decode's chunks (64k float32 elements); 3000 pairs a rank:
    # AVG divides the sent positions only; 60k: the whole vector.
    for numel, k in ((300_000, 3000), (300_000, 40_000), (70_001, 70_001)):
        gen = torch.Generator().manual_seed(comm.rank * 7 + k)
        idx = torch.randperm(numel, generator=gen)[:k].sort().values.to(torch.int32)
        val = torch.randn(k, generator=gen)
        shuffle = torch.randperm(k, generator=gen)
        for out_dtype in (torch.float32, torch.bfloat16):
            got = {}
            for order, (i, v) in (
                ("ascending", (idx, val)),
                ("shuffled", (idx[shuffle], val[shuffle])),
            ):
                for op in ("sum", "avg"):
                    out = torch.full((numel,), float("nan"), dtype=out_dtype)
                    comm.sparse_all_reduce(i, v, numel, out=out, op=op, algorithm="sparse_gather")
                    got[order, op] = out
            assert torch.equal(got["ascending", "sum"], got["shuffled", "sum"]), (
                numel,
                k,
                out_dtype,
            )
            assert torch.equal(got["ascending", "avg"], got["shuffled", "avg"]), (
                numel,
                k,
                out_dtype,
            )
            if out_dtype == torch.float32:  # AVG is the sum, divided (a true division)
                assert torch.equal(got["ascending", "avg"], got["ascending", "sum"] / n)
            results.append(got["ascending", "avg"].float().numpy().tobytes())
    # ascending with repeats: each rank's repeated positions add up in its order
    gen = torch.Generator().manual_seed(comm.rank)
    idx = torch.randint(0, 200_000, (50_000,), generator=gen).sort().values.to(torch.int32)
    val = torch.randint(-8, 9, (50_000,), generator=gen).float()
    ref = torch.zeros(200_000, dtype=torch.float64)
    for r in range(n):
        g = torch.Generator().manual_seed(r)
        i = torch.randint(0, 200_000, (50_000,), generator=g).sort().values
        ref.index_add_(0, i, torch.randint(-8, 9, (50_000,), generator=g).double())
    out = comm.sparse_all_reduce(idx, val, 200_000, algorithm="sparse_gather")
    assert torch.equal(out.double(), ref)
    return results


def test_ascending_and_shuffled_pairs_give_the_same_bits():
    # 3 ranks: AVG divides by 3, a true division (a power of two is a multiply)
    results = run_ranks(3, ordered_and_shuffled_pairs, timeout=120)
    assert all(r == results[0] for r in results)
