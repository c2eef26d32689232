"""CPU reduction kernels (the arithmetic the CUDA kernels share) against torch."""

import pytest
import torch

from ringcomm import _C
from ringcomm._buffers import TORCH_DTYPES

OPS = {"sum": 0, "prod": 2, "min": 3, "max": 4}


def torch_reduce(op, a, b):
    if a.dtype == torch.bool:
        return {"sum": a | b, "max": a | b, "prod": a & b, "min": a & b}[op]
    if a.dtype in (torch.float16, torch.bfloat16):
        fa, fb = a.float(), b.float()
        return torch_reduce(op, fa, fb).to(a.dtype)
    return {"sum": a + b, "prod": a * b, "min": torch.minimum(a, b), "max": torch.maximum(a, b)}[op]


def sample(dtype, n, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_floating_point:
        x = torch.randn(n, generator=gen, dtype=torch.float64) * 100
        x[::17] = 0.0
        x[1::17] = -0.0
        x[2::31] = float("inf")
        x[3::37] = float("nan")
        return x.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [0, 1, 15, 1000, 4099])
def test_reduce_matches_torch(dtype, op, n):
    gen = torch.Generator().manual_seed(n * 31 + OPS[op])
    a, b = sample(dtype, n, gen), sample(dtype, n, gen)
    out = torch.empty_like(a)
    _C.reduce_kernel(TORCH_DTYPES[dtype], OPS[op], out.data_ptr(), a.data_ptr(), b.data_ptr(), n)
    expect = torch_reduce(op, a, b)
    assert torch.equal(out.view(-1), expect.view(-1)) or (
        dtype.is_floating_point
        and torch.equal(out.isnan(), expect.isnan())
        and torch.equal(out[~out.isnan()], expect[~expect.isnan()])
    )


def test_half_rounding_is_nearest_even_over_all_fp16_values():
    # Every fp16 bit pattern plus a fixed addend: exercises subnormals, overflow and ties.
    a = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for addend in (0.0, 1e-4, 0.5, 3.0, -65504.0, 2.0**-24):
        b = torch.full_like(a, addend)
        out = torch.empty_like(a)
        _C.reduce_kernel(
            TORCH_DTYPES[torch.float16], 0, out.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel()
        )
        expect = (a.float() + b.float()).half()
        same = (out.view(torch.int16) == expect.view(torch.int16)) | (out.isnan() & expect.isnan())
        assert bool(same.all()), f"addend {addend}: {int((~same).sum())} mismatches"


def test_bf16_rounding_matches_torch():
    gen = torch.Generator().manual_seed(7)
    a = (torch.randn(100000, generator=gen) * 1e3).bfloat16()
    b = (torch.randn(100000, generator=gen) * 1e-1).bfloat16()
    out = torch.empty_like(a)
    _C.reduce_kernel(
        TORCH_DTYPES[torch.bfloat16], 0, out.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel()
    )
    assert torch.equal(out, (a.float() + b.float()).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_divide_is_true_division(dtype):
    x = (torch.arange(1, 2000, dtype=torch.float64) * 0.37).to(dtype)
    out = x.clone()
    _C.divide_kernel(TORCH_DTYPES[dtype], out.data_ptr(), out.numel(), 3)
    assert torch.equal(out, (x.float() / 3).to(dtype) if dtype != torch.float64 else x / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divisor", [1, 2, 4, 8, 64, 1 << 20, 6])
def test_divide_by_powers_of_two_gives_the_quotients_bits(dtype, divisor):
    # powers of two take a multiply by the exact reciprocal: the bits must still be x / divisor's,
    # across the range, subnormals, zeros, infinities and NaN
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}.get(dtype, torch.int16)
    gen = torch.Generator().manual_seed(divisor)
    if bits is torch.int16:
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        info = torch.finfo(dtype)
        # results that are subnormal: random mantissas just above the smallest normal
        near_tiny = (
            (1 + torch.rand(10_000, generator=gen, dtype=torch.float64))
            * info.tiny
            * 2.0 ** torch.randint(0, 21, (10_000,), generator=gen)
        )
        x = torch.cat(
            [
                near_tiny.to(dtype),
                -near_tiny.to(dtype),
                torch.randn(100_000, generator=gen, dtype=torch.float64).to(dtype)
                * torch.tensor(10.0, dtype=dtype)
                ** torch.randint(-40, 40, (100_000,), generator=gen).to(dtype),
                torch.tensor(
                    [
                        0.0,
                        -0.0,
                        info.tiny,
                        -info.tiny,
                        info.tiny / 3,
                        info.max,
                        -info.max,
                        float("inf"),
                        float("-inf"),
                        float("nan"),
                    ],
                    dtype=dtype,
                ),
            ]
        )
    out = x.clone()
    _C.divide_kernel(TORCH_DTYPES[dtype], out.data_ptr(), out.numel(), divisor)
    expect = (
        x / divisor if dtype in (torch.float32, torch.float64) else (x.float() / divisor).to(dtype)
    )
    nan = expect.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(bits), expect[~nan].view(bits))


def test_divide_truncates_integers_and_rejects_bool():
    x = torch.tensor([-7, -4, 3, 7], dtype=torch.int32)
    _C.divide_kernel(TORCH_DTYPES[torch.int32], x.data_ptr(), 4, 2)
    assert x.tolist() == [-3, -2, 1, 3]  # toward zero, as C and NCCL's avg
    b = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="bool"):
        _C.divide_kernel(TORCH_DTYPES[torch.bool], b.data_ptr(), 4, 2)


@pytest.mark.parametrize(
    "op,fn",
    [(0, lambda x, y: x + y), (2, lambda x, y: x * y), (3, torch.minimum), (4, torch.maximum)],
)
def test_bf16_over_all_bit_patterns(op, fn):
    # Every bfloat16 pattern (NaNs, infinities, subnormals) against a few operands, vector and
    # scalar tail alike (65536 is a multiple of 8, so the odd-length slice covers the tail).
    a = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for operand in (0.0, 1e-3, -3.5, 3e38, float("inf"), float("nan")):
        for x in (a, a[3:]):
            y = torch.full_like(x, operand)
            out = torch.empty_like(x)
            _C.reduce_kernel(
                TORCH_DTYPES[torch.bfloat16],
                op,
                out.data_ptr(),
                x.data_ptr(),
                y.data_ptr(),
                x.numel(),
            )
            expect = fn(x.float(), y.float()).bfloat16()
            same = (out.view(torch.int16) == expect.view(torch.int16)) | (
                out.isnan() & expect.isnan()
            )
            if op in (3, 4):  # min(-0, +0): ringcomm keeps the left operand, torch picks a zero
                same |= (out == 0) & (expect == 0)
            assert bool(same.all()), f"operand {operand}: {int((~same).sum())} mismatches"


def test_pack_list_joins_buffers_that_lie_back_to_back(tmp_path):
    """kernels::PackList in one process (tests/native/pack_list.cc): views of one buffer in order
    are walked as one buffer, empty ones are dropped, others stay apart, and pack and unpack over
    the joined list move the same elements."""
    import subprocess
    from ranks import build_native

    binary = build_native("pack_list", str(tmp_path))
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
