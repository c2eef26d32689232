"""Top-k kernels: exact against torch.topk, deterministic ties, error-feedback invariant."""
import random

import pytest
import torch

from ringcomm import compress

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def magnitude_key(t):
    """The kernel's order: bit pattern with the sign cleared (NaN above inf)."""
    if t.dtype == torch.float32:
        return t.view(torch.int32).long() & 0x7FFFFFFF
    return t.view(torch.int16).long() & 0x7FFF


def check_exact(x, k, values, indices):
    assert indices.dtype == torch.int32 and values.dtype == x.dtype
    assert values.numel() == k and indices.numel() == k
    idx = indices.long()
    assert torch.equal(idx, torch.sort(idx).values), "indices ascending"
    assert len(set(idx.tolist())) == k, "no duplicates"
    assert torch.equal(values.view(torch.int16 if x.element_size() == 2 else torch.int32),
                       x[idx].view(torch.int16 if x.element_size() == 2 else torch.int32)), "values with sign"
    keys = magnitude_key(x)
    if k == 0:
        return
    # Same selection as torch.topk over the keys, ties aside: the k-th largest key agrees, every
    # key above it is taken, and among keys equal to it the lowest indices are taken.
    kth = torch.topk(keys, k).values[-1]
    chosen = keys[idx]
    assert int(chosen.min()) == int(kth)
    above = torch.nonzero(keys > kth).flatten()
    assert set(above.tolist()) <= set(idx.tolist())
    ties = torch.nonzero(keys == kth).flatten()
    need = k - above.numel()
    assert set(ties[:need].tolist()) <= set(idx.tolist()), "ties: lowest index wins"


def check_error_feedback(grad, residual, k):
    """topk_with_residual(grad, residual, k): the exact top-k of acc = grad + residual (one
    rounding, in float), and what was sent plus what is still owed is acc, bit for bit."""
    acc = (grad.float() + residual.float()).to(grad.dtype)
    values, indices = compress.topk_with_residual(grad, residual, k)
    check_exact(acc, k, values, indices)
    sent = torch.zeros_like(acc)
    sent[indices.long()] = values
    assert torch.equal((sent.float() + residual.float()).to(grad.dtype), acc)
    assert bool((residual[indices.long()] == 0).all())


def random_input(n, dtype, gen, special=False):
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if special and n >= 10:
        x[torch.randint(0, n, (3,), generator=gen)] = float("inf")
        x[torch.randint(0, n, (2,), generator=gen)] = float("-inf")
        x[torch.randint(0, n, (2,), generator=gen)] = float("nan")
        x[torch.randint(0, n, (n // 10,), generator=gen)] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_matches_torch_over_many_sizes(dtype):
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(5)
    sizes = [0, 1, 2, 17, 1000, 4097, 131_071, 131_072, 300_001, 2_000_003]
    for n in sizes:
        for k in sorted({0, 1, n // 100, n // 7, n // 2, n} & set(range(n + 1))) + [rng.randint(0, n)]:
            x = random_input(n, dtype, gen, special=(n % 2 == 1))
            values, indices = compress.topk(x, k)
            check_exact(x, k, values, indices)


def test_nan_and_inf_rank_above_finite_values():
    x = torch.tensor([1.0, float("nan"), -float("inf"), 3.0, float("inf"), -5.0])
    values, indices = compress.topk(x, 3)
    assert indices.tolist() == [1, 2, 4]
    values, indices = compress.topk(x, 4)
    assert indices.tolist() == [1, 2, 4, 5] and values[-1].item() == -5.0


def test_ties_go_to_the_lowest_index_on_large_inputs():
    x = torch.ones(1_000_000)
    x[::3] = -1.0  # all magnitudes equal
    values, indices = compress.topk(x, 12345)
    assert indices.tolist() == list(range(12345))
    x = torch.zeros(500_000, dtype=torch.bfloat16)
    values, indices = compress.topk(x, 100)
    assert indices.tolist() == list(range(100))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fewer_nonzeros_than_k_takes_the_first_zeros(dtype):
    """A sparse gradient: the sampled threshold is zero, and the zeros that complete the top k
    are the ones of lowest index (collected as needed, not all of them)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1_000_003, 10_000
    x = torch.zeros(n, dtype=dtype)
    nonzero = torch.randperm(n, generator=gen)[:3000]
    x[nonzero] = torch.randn(3000, generator=gen).to(dtype)
    x[nonzero[:5]] = -0.0  # a negative zero is a zero
    values, indices = compress.topk(x, k)
    check_exact(x, k, values, indices)
    residual = torch.zeros(n, dtype=dtype)
    values, indices = compress.topk_with_residual(x, residual, k)
    check_exact(x, k, values, indices)
    assert torch.count_nonzero(residual) == 0  # every non-zero was sent


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(0, 0), (1, 1), (1000, 0), (1000, 10), (1000, 1000), (777_777, 7777)])
def test_error_feedback_invariant_is_exact(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    grad = random_input(n, dtype, gen)
    residual = random_input(n, dtype, gen) * 0.01
    check_error_feedback(grad, residual, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_threshold_set_too_high_is_lowered_and_scanned_again(dtype):
    """Large values in a few long blocks: the sample's runs hit them or miss them wholesale, and
    with these shapes and seeds (found by instrumenting the kernel) the first scan collects fewer
    than k, so it scans again with a lower threshold, after writing the first scan's candidates
    (zeroed in the residual during the scan) back."""
    n = 1_000_000
    for blocks, size, k, seed in ((2, 16384, 30000, 3), (8, 4096, 31000, 4), (3, 8192, 24000, 1)):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=gen) * 1e-3
        for start in torch.randint(0, n - size, (blocks,), generator=gen).tolist():
            x[start:start + size] = torch.randn(size, generator=gen) * 10
        x = x.to(dtype)
        values, indices = compress.topk(x, k)
        check_exact(x, k, values, indices)
        check_error_feedback(x, (torch.randn(n, generator=gen) * 1e-4).to(dtype), k)


def test_error_feedback_accumulates_over_steps():
    gen = torch.Generator().manual_seed(0)
    residual = torch.zeros(200_000)
    total_grad, total_sent = torch.zeros(200_000, dtype=torch.float64), torch.zeros(200_000, dtype=torch.float64)
    for _ in range(20):
        grad = torch.randn(200_000, generator=gen)
        values, indices = compress.topk_with_residual(grad, residual, 2000)
        total_grad += grad.double()
        total_sent.index_add_(0, indices.long(), values.double())
    # nothing is lost: what was sent plus what is still owed equals everything accumulated
    assert torch.allclose(total_sent + residual.double(), total_grad, atol=1e-4)


def test_bad_arguments():
    with pytest.raises(TypeError, match="float32"):
        compress.topk(torch.ones(4, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="out of range"):
        compress.topk(torch.ones(4), 5)
    with pytest.raises(ValueError, match="contiguous"):
        compress.topk(torch.ones(4, 4).t(), 2)
    with pytest.raises(ValueError, match="must match"):
        compress.topk_with_residual(torch.ones(4), torch.ones(5), 1)
