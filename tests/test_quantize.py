"""8-bit quantization with an agreed scale: the shared arithmetic (kernels/quantize_math.h) through
the CPU kernels against its formulas, and QuantizeState over real ranks (DDP and GradientAverager):
the same bits on every rank whatever the all-reduce algorithm, error feedback losing nothing."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm
from ranks import run_ranks
from ringcomm import compress
from ringcomm.hooks import QuantizeState, quantize_hook
from test_topk_hook import digits_batches, make_model  # tests/ is on sys.path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_ranges(acc: torch.Tensor, chunk: int) -> torch.Tensor:
    out = []
    for piece in acc.float().split(chunk):
        out += [-piece.min() + 0.0, piece.max() + 0.0]
    return torch.stack(out)


def agreed(*ranges):
    return torch.stack(ranges).max(0).values


def scales(ranges: torch.Tensor, levels: int):
    """Per chunk (lo, step, inverse), by the formulas of quantize_math.h in float32."""
    lo = -ranges[0::2]
    span = ranges[1::2] - lo
    step = span / levels
    inverse = torch.where(span > 0, levels / span, torch.zeros_like(span))
    return lo, step, inverse


def per_element(values: torch.Tensor, chunk: int, numel: int) -> torch.Tensor:
    return values.repeat_interleave(chunk)[:numel]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,chunk", [(1, 1), (1000, 1024), (5000, 1024), (4097, 64)])
def test_ranges_are_each_chunks_min_and_max_after_error_feedback(dtype, numel, chunk):
    gen = torch.Generator().manual_seed(numel)
    grad = torch.randn(numel, generator=gen).to(dtype)
    assert torch.equal(compress.quantize_ranges(grad, None, chunk), reference_ranges(grad, chunk))
    residual = torch.randn(numel, generator=gen).to(dtype)
    expect = (grad.float() + residual.float()).to(dtype)  # added in float, rounded once
    ranges = compress.quantize_ranges(grad, residual, chunk)
    assert torch.equal(residual, expect)
    assert torch.equal(ranges, reference_ranges(expect, chunk))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_holding_a_nan_or_an_infinity(dtype):
    # The kernel keeps four running minima and maxima, which a NaN passes by: a chunk holding one
    # must still report NaN, and one holding an infinity the infinity, wherever it sits (first
    # lane, last lane, the tail after the last four), and its codes are 0.
    chunk = 39
    for position in (0, 3, 17, 36, 38):
        x = torch.randn(4 * chunk, generator=torch.Generator().manual_seed(position)).to(dtype)
        x[chunk + position] = float("nan")
        x[2 * chunk + position] = float("inf")
        x[3 * chunk + position] = float("-inf")
        ranges = compress.quantize_ranges(x, None, chunk)
        torch.testing.assert_close(
            ranges, reference_ranges(x, chunk), rtol=0, atol=0, equal_nan=True
        )
        codes = compress.quantize(x, ranges, chunk, 63)
        assert int(codes[chunk : 2 * chunk].max()) == 0, position


def test_zeros_in_ranges_are_positive_zeros():
    # max does not order -0 and +0: every rank writes +0, so every algorithm agrees
    ranges = compress.quantize_ranges(torch.tensor([-0.0, -0.0, 0.0, 0.0]), None, 2)
    assert all(v == 0 and not torch.signbit(v) for v in ranges)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels", [1, 31, 127, 255])
def test_nearest_codes_and_what_they_lose_follow_the_formula(dtype, levels):
    numel, chunk = 3000, 256
    gen = torch.Generator().manual_seed(levels)
    source = (torch.randn(numel, generator=gen) * 3).to(dtype)
    ranges = compress.quantize_ranges(source, None, chunk)
    error = torch.empty_like(source)
    codes = compress.quantize(source, ranges, chunk, levels, error=error)
    lo, step, inverse = (per_element(v, chunk, numel) for v in scales(ranges, levels))
    x = source.float()
    want = torch.floor((x - lo) * inverse + 0.5).clamp(0, levels)
    assert torch.equal(codes, want.to(torch.uint8))
    value = lo + want * step
    assert torch.equal(error, (x - value).to(dtype))
    # within half a step, and the extremes of each chunk land on its ends
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs() + lo.abs())  # the float32 rounding
    assert bool(((x - value).abs() <= step / 2 + slack).all())
    for c, piece in enumerate(codes.split(chunk)):
        assert piece.min() == 0 and piece.max() == levels, c


def test_stochastic_rounding_is_seeded_and_unbiased():
    numel, chunk, levels = 4096, 512, 15
    x = torch.linspace(-1, 1, numel)
    ranges = compress.quantize_ranges(x, None, chunk)
    a = compress.quantize(x, ranges, chunk, levels, key=7)
    assert torch.equal(a, compress.quantize(x, ranges, chunk, levels, key=7))
    assert not torch.equal(a, compress.quantize(x, ranges, chunk, levels, key=8))
    nearest = compress.quantize(x, ranges, chunk, levels)
    assert not torch.equal(a, nearest)
    lo, step, _ = (per_element(v, chunk, numel) for v in scales(ranges, levels))
    draws = torch.stack(
        [lo + compress.quantize(x, ranges, chunk, levels, key=k).float() * step for k in range(400)]
    )
    assert bool(((draws - x).abs() < step * (1 + 1e-5)).all())  # one of the two nearest codes
    # the mean of the draws is x: 400 draws of a spread of at most one step, 4 sigmas
    assert float((draws.mean(0) - x).abs().max()) < 4 * float(step.max()) / 2 / 400**0.5


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 255])
def test_every_ranks_codes_sum_within_a_byte_to_the_mean(world):
    numel, chunk = 2000, 128
    levels = compress.CODE_SUM // world
    gen = torch.Generator().manual_seed(world)
    grads = [torch.randn(numel, generator=gen) * (r + 1) for r in range(world)]
    ranges = agreed(*[compress.quantize_ranges(g, None, chunk) for g in grads])
    codes = [compress.quantize(g, ranges, chunk, levels) for g in grads]
    total = torch.stack([c.int() for c in codes]).sum(0)
    assert int(total.max()) <= 255
    sums = total.to(torch.uint8)
    mean = compress.dequantize_mean(sums, ranges, chunk, levels, world)
    lo, step, _ = (per_element(v, chunk, numel) for v in scales(ranges, levels))
    assert torch.equal(mean, lo + step * (total.float() / world))
    true = torch.stack(grads).mean(0)
    assert bool(((mean - true).abs() <= step / 2 * (1 + 1e-4)).all())
    for dtype in (torch.float16, torch.bfloat16):
        out = compress.dequantize_mean(
            sums, ranges, chunk, levels, world, out=torch.empty(numel, dtype=dtype)
        )
        assert torch.equal(out, mean.to(dtype))


def test_a_constant_chunk_decodes_exactly():
    x = torch.full((300,), 2.5)
    ranges = compress.quantize_ranges(x, None, 100)
    error = torch.empty_like(x)
    codes = compress.quantize(x, ranges, 100, 63, error=error)
    assert int(codes.max()) == 0 and bool((error == 0).all())
    assert torch.equal(compress.dequantize_mean(codes, ranges, 100, 63, 4), x)


def test_bad_arguments():
    x = torch.randn(10)
    ranges = compress.quantize_ranges(x, None, 4)
    with pytest.raises(ValueError, match="levels"):
        compress.quantize(x, ranges, 4, 0)
    with pytest.raises(ValueError, match="levels"):
        compress.quantize(x, ranges, 4, 256)
    with pytest.raises(ValueError, match="ranges has"):
        compress.quantize(x, ranges, 5, 7)
    with pytest.raises(TypeError, match="dtype"):
        compress.quantize_ranges(torch.arange(10), None, 4)
    with pytest.raises(TypeError, match="dtype"):
        compress.quantize_ranges(x, torch.zeros(10, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="chunk"):
        compress.quantize_ranges(x, None, 0)
    with pytest.raises(ValueError, match="world"):
        compress.dequantize_mean(torch.zeros(10, dtype=torch.uint8), ranges, 4, 7, 0)
    with pytest.raises(ValueError, match="rounding"):
        QuantizeState(rounding="up")


# -- over real ranks ------------------------------------------------------------------------------


def train_ddp(store, rank, world, rounding, steps):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(make_model(), bucket_cap_mb=0.05)  # several buckets
    state = QuantizeState(rounding=rounding)
    model.register_comm_hook(state, quantize_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for xb, yb in digits_batches(rank, world, steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    restored = QuantizeState()
    restored.load_state_dict(state.state_dict())
    round_trip = (
        restored.step == state.step
        and restored.rounding == rounding
        and all(torch.equal(restored.residuals[i], t) for i, t in state.residuals.items())
    )
    stats = state.stats
    dist.destroy_process_group()
    return dict(
        losses=losses,
        params=params,
        steps=stats.steps,
        round_trip=round_trip,
        compressed=stats.compressed_buckets,
        dense=stats.dense_buckets,
        ratio=stats.compression_ratio,
    )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_ddp_trains_with_quantize_hook(rounding):
    results = run_ranks(3, train_ddp, rounding, 30, make_comm=False, timeout=180)
    for r in results:
        assert r["steps"] == 30 and r["compressed"] > 0 and r["dense"] == 0 and r["round_trip"]
        assert r["ratio"] > 3, r["ratio"]  # a byte per float32, plus the ranges and headers
        assert sum(r["losses"][-5:]) < sum(r["losses"][:5])
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)


def averaged_steps(comm, steps):
    """GradientAverager with QuantizeState over `steps` steps of fixed gradients: each step's
    average and every rank's local gradients."""
    torch.manual_seed(comm.rank)
    params = [nn.Parameter(torch.zeros(3000)), nn.Parameter(torch.zeros(50, 40))]
    local = [torch.randn_like(p) for p in params]
    state = QuantizeState(chunk=256)
    averager = ringcomm.GradientAverager(params, comm, compression=state)
    seen = []
    for _ in range(steps):
        for p, g in zip(params, local):
            p.grad = g.clone()
        averager.step()
        seen.append([p.grad.clone() for p in params])
    averager.remove()
    return seen, local


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_averager_gives_every_rank_the_kernels_mean_whatever_the_algorithm(algorithm):
    world, steps = 3, 6
    results = run_ranks(world, averaged_steps, steps, env={"RINGCOMM_ALGO": algorithm})
    first = [torch.cat([g.reshape(-1) for g in r[0][0]]) for r in results]
    assert all(torch.equal(f, first[0]) for f in first)
    # the first step, worked out here from every rank's gradients (the bucket: both, flattened
    # in reverse order, the parameters' order in backward)
    grads = [torch.cat([g.reshape(-1) for g in reversed(r[1])]) for r in results]
    levels = compress.CODE_SUM // world
    ranges = agreed(*[compress.quantize_ranges(g, None, 256) for g in grads])
    total = torch.stack([compress.quantize(g, ranges, 256, levels).int() for g in grads]).sum(0)
    mean = compress.dequantize_mean(total.to(torch.uint8), ranges, 256, levels, world)
    got = torch.cat([g.reshape(-1) for g in reversed(results[0][0][0])])
    assert torch.equal(got, mean)
    # error feedback: the averages of `steps` steps add up to `steps` true averages, to within
    # what one step's quantization leaves in the residuals
    true = torch.stack(grads).mean(0)
    sent = sum(torch.cat([g.reshape(-1) for g in reversed(step)]) for step in results[0][0])
    _, step_size, _ = scales(ranges, levels)
    assert float((sent - steps * true).abs().max()) <= float(step_size.max()) * 1.01


def test_averager_result_does_not_depend_on_the_algorithm():
    ring = run_ranks(3, averaged_steps, 3, env={"RINGCOMM_ALGO": "ring"})
    doubling = run_ranks(3, averaged_steps, 3, env={"RINGCOMM_ALGO": "recursive_doubling"})
    for a, b in zip(ring[0][0], doubling[0][0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- the CUDA kernels' build (tests/gpu/test_cuda_quantize.py runs them) --------------------------------


def test_cuda_kernels_are_built_for_sm80_and_sm90_and_check_their_arguments():
    import subprocess
    from test_cuda_build import cuobjdump, extension_path, needs_build

    if needs_build.args[0]:
        pytest.skip(needs_build.kwargs["reason"])
    out = subprocess.run(
        [cuobjdump(), "-symbols", str(extension_path())], capture_output=True, text=True, check=True
    ).stdout
    entries, arch = {}, None
    for line in out.splitlines():
        if line.startswith("arch = "):
            arch = line.split()[-1]
        elif " ENTRY " in line and arch:
            entries.setdefault(arch, set()).add(line.split()[-1])
    for arch in ("sm_80", "sm_90"):
        for kernel in ("ranges_kernel", "quantize_kernel", "mean_kernel"):
            assert any("quantize_cu" in e and kernel in e for e in entries.get(arch, ())), (
                arch,
                kernel,
            )
    from ringcomm import _C_cuda

    with pytest.raises(ValueError, match="8-bit quantization does not support"):
        _C_cuda.quantize_ranges(6, 0, 0, 10, 4, 0, 0)
    with pytest.raises(ValueError, match="levels"):
        _C_cuda.quantize(0, 0, 0, 10, 4, 0, 256, False, 0, 0, 0)
    with pytest.raises(ValueError, match="chunk"):
        _C_cuda.dequantize_mean(0, 10, 0, 0, 7, 2, 0, 0, 0)


def mixed_buckets(store, rank, world, steps):
    """topk_hook (its whole level) and quantize_hook on three buckets a step, float32, float64
    (which neither compresses) and float32, issued without waiting, rank 1 late with each next
    bucket: the codes of a bucket go out from its ranges' completion meanwhile."""
    import time

    from test_topk_hook import Bucket

    from ringcomm.hooks import TopKState, topk_hook

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(rank)
    grads = [torch.randn(20_000), torch.randn(500, dtype=torch.float64), torch.randn(3000)]
    parameters = [torch.zeros_like(g) for g in grads]
    results = {}
    for name, state, hook in (
        ("topk", TopKState(dense_steps=0), topk_hook),
        ("quantize", QuantizeState(), quantize_hook),
    ):
        outs = []
        for _ in range(steps):
            futures = []
            for i, g in enumerate(grads):
                last = i == len(grads) - 1
                futures.append(hook(state, Bucket(g.clone(), i, last, parameters[i])))
                if rank == 1:
                    time.sleep(0.05)
            outs.append([f.wait() for f in futures])
        results[name] = (outs, dict(state.stats.dense_reasons), dict(state.residuals))
    dist.destroy_process_group()
    return results, grads


def test_topk_whole_level_is_the_quantizers_average_and_whole_buckets_keep_the_order():
    world, steps = 3, 3
    results = run_ranks(world, mixed_buckets, steps, make_comm=False, timeout=120)
    first = results[0][0]
    float64_mean = torch.stack([r[1][1] for r in results]).mean(0)
    for got, _ in results:
        for name in ("topk", "quantize"):
            for step in range(steps):
                for a, b in zip(got[name][0][step], first[name][0][step]):
                    assert torch.equal(a, b), (name, step)  # every rank, the same bits
                assert torch.allclose(got[name][0][step][1], float64_mean, rtol=0, atol=1e-12)
        # top-k's first steps are whole, as 8-bit codes: QuantizeState's average and residuals
        for step in range(steps):
            for i in (0, 2):
                assert torch.equal(got["topk"][0][step][i], got["quantize"][0][step][i]), step
        for slot, residual in got["quantize"][2].items():
            assert torch.equal(got["topk"][2][slot], residual)
        assert got["topk"][1] == {
            "whole as 8-bit codes: critical regime": 2 * steps,
            "torch.float64 is not compressed": steps,
        }


def whole_level_variants(store, rank, world, steps):
    """topk_hook's whole level (8-bit codes) without error feedback, with momentum correction and
    with clipping, each against quantize_hook fed what that variant quantizes: the gradient
    itself, the velocity, the clipped gradient."""
    from test_topk_hook import Bucket

    from ringcomm.hooks import TopKState, topk_hook

    parameter = torch.zeros(20_000)

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(rank)
    grad = torch.randn(20_000) * (1 + rank)
    momentum, clip_norm = 0.5, 10.0
    limit = clip_norm / world**0.5
    clipped = grad * (limit / float(torch.linalg.vector_norm(grad)))
    velocity = torch.zeros_like(grad)
    velocities = [velocity.mul_(momentum).add_(grad).clone() for _ in range(steps)]
    variants = {
        "no error feedback": (
            TopKState(dense_steps=0, error_feedback=False),
            QuantizeState(error_feedback=False),
            [grad] * steps,
        ),
        "momentum correction": (
            TopKState(dense_steps=0, momentum_correction=True, momentum=momentum),
            QuantizeState(),
            velocities,
        ),
        "clipped": (
            TopKState(dense_steps=0, clip_norm=clip_norm),
            QuantizeState(),
            [clipped] * steps,
        ),
    }
    results = {}
    for name, (topk_state, quantize_state, fed) in variants.items():
        outs = []
        for step in range(steps):
            got = topk_hook(topk_state, Bucket(grad.clone(), 0, True, parameter)).wait()
            want = quantize_hook(quantize_state, Bucket(fed[step].clone(), 0, True, parameter))
            outs.append((got, want.wait()))
        results[name] = (
            outs,
            dict(topk_state.stats.dense_reasons),
            dict(topk_state.residuals),
            dict(quantize_state.residuals),
        )
    dist.destroy_process_group()
    return results


def test_topk_whole_level_without_error_feedback_with_momentum_or_clipped_is_the_quantizers():
    world, steps = 2, 3
    results = run_ranks(world, whole_level_variants, steps, make_comm=False, timeout=120)
    for got in results:
        for name, (outs, reasons, topk_residuals, quantize_residuals) in got.items():
            assert reasons == {"whole as 8-bit codes: critical regime": steps}, name
            for step, (topk_average, quantize_average) in enumerate(outs):
                assert torch.equal(topk_average, quantize_average), (name, step)
                assert torch.equal(topk_average, results[0][name][0][step][0]), (name, step)
            assert topk_residuals.keys() == quantize_residuals.keys(), name
            for slot, residual in quantize_residuals.items():
                assert torch.equal(topk_residuals[slot], residual), (name, slot)
        assert got["no error feedback"][2] == {}
