"""Top-k kernels: exact against torch.topk, deterministic ties, error-feedback invariant."""

import random

import pytest
import torch

from ringcomm import compress
from ringcomm._buffers import TORCH_DTYPES

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
    assert torch.equal(
        values.view(torch.int16 if x.element_size() == 2 else torch.int32),
        x[idx].view(torch.int16 if x.element_size() == 2 else torch.int32),
    ), "values with sign"
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
        for k in sorted({0, 1, n // 100, n // 7, n // 2, n} & set(range(n + 1))) + [
            rng.randint(0, n)
        ]:
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
@pytest.mark.parametrize(
    "n,k", [(0, 0), (1, 1), (1000, 0), (1000, 10), (1000, 1000), (777_777, 7777)]
)
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
            x[start : start + size] = torch.randn(size, generator=gen) * 10
        x = x.to(dtype)
        values, indices = compress.topk(x, k)
        check_exact(x, k, values, indices)
        check_error_feedback(x, (torch.randn(n, generator=gen) * 1e-4).to(dtype), k)


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("value_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_in_another_type_leave_their_rounding_in_the_residual(dtype, value_dtype):
    """value_dtype: the values come rounded to it (nearest even), and the residual keeps, at each
    selected entry, what that rounding lost: bit for bit what torch's own `values.to(value_dtype)`
    and `residual.index_add_(0, indices, values - wire.to(dtype))` give after the selection in the
    element type. Every path: the scan (float32's vector lanes and their scalar tail), the scan
    after a threshold set too high, the direct selection of small inputs, and the zeros that
    complete a sparse gradient; infinities and values that round up to infinity included."""
    gen = torch.Generator().manual_seed(7)
    cases = [
        (random_input(1_000_003, dtype, gen, special=True), 20_000, 1e-2),
        (random_input(5_003, dtype, gen), 700, 1e-2),
    ]
    blocks = torch.randn(1_000_000, generator=gen) * 1e-3
    blocks[:16384] = torch.randn(16384, generator=gen) * 10
    blocks[600_000:616_384] = torch.randn(16384, generator=gen) * 10
    cases.append((blocks.to(dtype), 30_000, 1e-2))  # the first scan collects too few (see above)
    # A sparse gradient with negative zeros, and a residual of negative zeros (so that acc keeps
    # them): the zeros that complete the top k owe +0.
    sparse = torch.zeros(300_001)
    sparse[torch.randperm(300_001, generator=gen)[:500]] = 1.0 + torch.rand(500, generator=gen)
    sparse[torch.randperm(300_001, generator=gen)[:50_000]] = -0.0
    cases.append((sparse.to(dtype), 2_000, -0.0))
    # Ties: float32 values halfway between two bfloat16 values, which round to the even one.
    halfway = torch.randn(200_000, generator=gen).view(torch.int32) & ~0xFFFF | 0x8000
    cases.append((halfway.view(torch.float32).to(dtype), 50_000, 0.0))
    # Values that round up to infinity as bfloat16 (float32's largest), or as float16 in a
    # float16 residual (float16's largest values, as bfloat16, exceed float16's range).
    top = 3.0e38 if dtype == torch.float32 else torch.finfo(dtype).max
    cases.append(
        ((top * (0.99 + 0.01 * torch.rand(200_000, generator=gen))).to(dtype), 4_000, 1e-2)
    )
    for grad, k, scale in cases:  # the residual: random values of that scale, or all that zero
        residual = (
            torch.randn(grad.numel(), generator=gen) * scale
            if scale
            else torch.full((grad.numel(),), scale)
        ).to(dtype)
        expected_residual = residual.clone()
        full, expected_indices = compress.topk_with_residual(grad, expected_residual, k)
        wire = full.to(value_dtype)
        if value_dtype != dtype:  # (an infinity would owe inf - inf)
            expected_residual.index_add_(0, expected_indices.long(), full - wire.to(dtype))
        values, indices = compress.topk_with_residual(grad, residual, k, value_dtype)
        assert values.dtype == value_dtype and torch.equal(indices, expected_indices)
        finite = ~torch.isnan(wire)
        assert torch.equal(bits(values)[finite], bits(wire)[finite])
        assert torch.equal(torch.isnan(values), ~finite)
        same = ~torch.isnan(expected_residual)
        assert torch.equal(bits(residual)[same], bits(expected_residual)[same])
        assert torch.equal(torch.isnan(residual), ~same)


def test_a_wire_type_outside_top_k_is_refused():
    with pytest.raises(TypeError, match="value_dtype"):
        compress.topk_with_residual(torch.ones(4), torch.zeros(4), 1, torch.float64)
    # the kernel itself, reached without the Python check, refuses it as well
    grad, residual = torch.ones(4), torch.zeros(4)
    values, indices = torch.empty(1, dtype=torch.float64), torch.empty(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="top-k does not support float64"):
        compress._C.topk_with_residual_kernel(
            TORCH_DTYPES[torch.float32],
            grad.data_ptr(),
            residual.data_ptr(),
            4,
            1,
            indices.data_ptr(),
            values.data_ptr(),
            TORCH_DTYPES[torch.float64],
        )


def test_error_feedback_accumulates_over_steps():
    gen = torch.Generator().manual_seed(0)
    residual = torch.zeros(200_000)
    total_grad, total_sent = (
        torch.zeros(200_000, dtype=torch.float64),
        torch.zeros(200_000, dtype=torch.float64),
    )
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
