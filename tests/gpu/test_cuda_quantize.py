"""The CUDA 8-bit quantization kernels against the CPU ones (both run kernels/quantize_math.h):
the same ranges, codes, errors and means, bit for bit; and QuantizeState averaging CUDA gradients
to the bits it gives CPU ones."""

import pytest
import torch

from ranks import run_ranks
from ringcomm import compress
from test_cuda_kernels import same_bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [(1, 1), (1000, 1024), (5000, 1024), (100_003, 256), (1 << 20, 4096)]


def sample(dtype, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,chunk", SIZES)
def test_ranges_match_the_cpu_kernel(dtype, n, chunk):
    grad, residual = sample(dtype, n, 1), sample(dtype, n, 2)
    want_residual = residual.clone()
    want = compress.quantize_ranges(grad, want_residual, chunk)
    got_residual = residual.cuda()
    got = compress.quantize_ranges(grad.cuda(), got_residual, chunk)
    assert same_bits(got, want) and same_bits(got_residual, want_residual)
    assert same_bits(
        compress.quantize_ranges(grad.cuda(), None, chunk),
        compress.quantize_ranges(grad, None, chunk),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,chunk", SIZES)
@pytest.mark.parametrize("key", [None, 12345])
def test_codes_errors_and_means_match_the_cpu_kernel(dtype, n, chunk, key):
    source = sample(dtype, n, 3)
    ranges = compress.quantize_ranges(source, None, chunk)
    levels, world = 63, 4
    error = torch.empty_like(source)
    codes = compress.quantize(source, ranges, chunk, levels, error=error, key=key)
    gpu_error = torch.empty_like(source).cuda()
    gpu_codes = compress.quantize(
        source.cuda(), ranges.cuda(), chunk, levels, error=gpu_error, key=key
    )
    assert same_bits(gpu_codes, codes) and same_bits(gpu_error, error)
    sums = (codes.int() * 4).clamp(max=255).to(torch.uint8)  # any sums of four ranks' codes
    for out_dtype in DTYPES:
        want = compress.dequantize_mean(
            sums, ranges, chunk, levels, world, out=torch.empty(n, dtype=out_dtype)
        )
        got = compress.dequantize_mean(
            sums.cuda(),
            ranges.cuda(),
            chunk,
            levels,
            world,
            out=torch.empty(n, dtype=out_dtype, device="cuda"),
        )
        assert same_bits(got, want)


def averaged(comm, device):
    import torch.nn as nn
    import ringcomm
    from ringcomm.hooks import QuantizeState

    torch.manual_seed(comm.rank)
    params = [
        nn.Parameter(torch.zeros(3000, device=device)),
        nn.Parameter(torch.zeros(40, 50, device=device)),
    ]
    local = [torch.randn(p.shape) for p in params]
    averager = ringcomm.GradientAverager(params, comm, compression=QuantizeState(chunk=256))
    seen = []
    for _ in range(3):
        for p, g in zip(params, local):
            p.grad = g.to(device)
        averager.step()
        seen.append([p.grad.cpu() for p in params])
    averager.remove()
    return seen


def test_quantize_state_averages_cuda_gradients_to_the_cpu_bits():
    cpu = run_ranks(2, averaged, "cpu", timeout=240)
    gpu = run_ranks(2, averaged, "cuda", timeout=240)
    for a, b in zip(cpu, gpu):
        for step_a, step_b in zip(a, b):
            assert all(same_bits(x, y) for x, y in zip(step_b, step_a))
