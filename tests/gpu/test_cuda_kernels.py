"""ringcomm's CUDA kernels on a GPU, against torch on the same GPU and against ringcomm's CPU
kernels (which share their arithmetic): bit-exact where the CPU kernels are bit-exact."""

import pytest
import torch

import ringcomm.backend
import ringcomm.cuda as rc_cuda
from ringcomm import _C, compress, fusion
from ringcomm._buffers import TORCH_DTYPES
from test_kernels import sample  # the CPU kernels' tests' inputs (tests/ is on sys.path)
from test_topk import random_input

DEVICE = "cuda"
OPS = {"sum": 0, "prod": 2, "min": 3, "max": 4, "band": 5, "bor": 6, "bxor": 7}
TOPK_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cpu_reduce(dtype, op, a, b):
    """ringcomm's CPU kernel: the reference, since both sides run kernels/reduce_math.h."""
    out = torch.empty_like(a)
    _C.reduce_kernel(
        TORCH_DTYPES[dtype], OPS[op], out.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel()
    )
    return out


def same_bits(x, y):
    """Bit for bit, except that a NaN matches any NaN: IEEE 754 leaves a NaN result's payload
    and sign open, and the GPU's float32 arithmetic returns its one canonical NaN (0x7fffffff)
    where x86 returns the operand's NaN or its own default (0xffc00000). On a mismatch, the
    AssertionError says how many elements differ and shows the first ones' bits."""
    x, y = x.cpu(), y.cpu()
    assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, x.shape, y.dtype, y.shape)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    differ = x.view(bits) != y.view(bits)
    if x.is_floating_point():
        differ &= ~(x.isnan() & y.isnan())
    if differ.any():
        where = differ.nonzero().flatten()[:5].tolist()
        shown = [
            (i, x[i].item(), y[i].item(), hex(x.view(bits)[i].item()), hex(y.view(bits)[i].item()))
            for i in where
        ]
        raise AssertionError(
            f"{int(differ.sum())} of {x.numel()} elements differ (index, got, want, bits): {shown}"
        )
    return True


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("op", list(OPS))
# Aligned: one element (a tail only), one chunk with a tail for 1- and 2-byte dtypes, many chunks
# without and with a tail; misaligned: the element-by-element path.
@pytest.mark.parametrize(
    "n,offset", [(1, 0), (1000, 0), (4099, 1), (1 << 20, 0), ((1 << 20) + 3, 0), (1 << 20, 3)]
)
def test_reduce_matches_the_cpu_kernel_bit_for_bit(dtype, op, n, offset):
    if op in ("band", "bor", "bxor") and dtype.is_floating_point:
        pytest.skip("bitwise ops are for integers and bool")
    gen = torch.Generator().manual_seed(n + OPS[op])
    a, b = sample(dtype, n + offset, gen)[offset:], sample(dtype, n + offset, gen)[offset:]
    expect = cpu_reduce(dtype, op, a.contiguous(), b.contiguous())
    # offset > 0: misaligned views, the element-by-element path.
    ga = sample(dtype, n + offset, gen).to(DEVICE)[offset:]
    gb = sample(dtype, n + offset, gen).to(DEVICE)[offset:]
    ga.copy_(a)
    gb.copy_(b)
    out = torch.empty_like(ga)
    rc_cuda.reduce_(out, ga, gb, op)
    assert same_bits(out, expect)
    rc_cuda.reduce_(ga, ga, gb, op)  # in place
    assert same_bits(ga, expect)


def test_reduce_matches_torch_on_the_gpu():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    a = torch.randn(3 << 20, device=DEVICE, generator=gen)
    b = torch.randn(3 << 20, device=DEVICE, generator=gen)
    assert torch.equal(rc_cuda.reduce_(torch.empty_like(a), a, b, "sum"), a + b)
    assert torch.equal(rc_cuda.reduce_(torch.empty_like(a), a, b, "max"), torch.maximum(a, b))
    h, g = a.half(), b.half()
    assert torch.equal(
        rc_cuda.reduce_(torch.empty_like(h), h, g, "sum"), (h.float() + g.float()).half()
    )


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64]
)
def test_divide_matches_the_cpu_kernel(dtype):
    x = sample(dtype, 10_001, torch.Generator().manual_seed(2))
    expect = x.clone()
    _C.divide_kernel(TORCH_DTYPES[dtype], expect.data_ptr(), expect.numel(), 3)
    gx = x.to(DEVICE)
    rc_cuda.divide_(gx, 3)
    assert same_bits(gx, expect)


def test_reduce_rejects_bad_arguments():
    a = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="CUDA tensor"):
        rc_cuda.reduce_(a, a, torch.ones(4), "sum")
    with pytest.raises(ValueError, match="must match"):
        rc_cuda.reduce_(a, a, torch.ones(5, device=DEVICE), "sum")
    with pytest.raises(ValueError, match="bitwise|needs an integer"):
        rc_cuda.reduce_(a, a, a, "band")
    with pytest.raises(ValueError, match="avg is undefined on bool"):
        b = torch.ones(4, dtype=torch.bool, device=DEVICE)
        rc_cuda.reduce_(b, b, b, "avg")


@pytest.mark.parametrize("dtype", TOPK_DTYPES)
@pytest.mark.parametrize("n", [1, 17, 4096, 4097, 131_073, 2_000_003])
def test_topk_selects_what_the_cpu_kernel_selects(dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = random_input(n, dtype, gen, special=n % 2 == 1)
    for k in sorted({0, 1, n // 100, n // 3, n}):
        values, indices = rc_cuda.topk(x.to(DEVICE), k)
        cpu_values, cpu_indices = compress.topk(x, k)
        assert torch.equal(indices.cpu(), cpu_indices)
        assert same_bits(values, cpu_values)


def test_topk_ties_go_to_the_lower_index():
    x = torch.ones(1_000_000, device=DEVICE)
    x[::3] = -1.0
    values, indices = rc_cuda.topk(x, 12345)
    assert indices.tolist() == list(range(12345))
    x = torch.tensor([1.0, 2.0, 2.0, 3.0, 2.0] * 1000, device=DEVICE)
    _, indices = rc_cuda.topk(x, 1500)
    expect = torch.nonzero(x.cpu() == 3.0).flatten().tolist()
    expect = sorted(expect + torch.nonzero(x.cpu() == 2.0).flatten().tolist()[:500])
    assert indices.tolist() == expect


def test_topk_matches_torch_topk_as_a_set():
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    x = torch.randn(25_000_000, device=DEVICE, generator=gen)
    k = 250_000
    values, indices = rc_cuda.topk(x, k)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(indices.long(), ref)
    assert torch.equal(values, x[ref])


@pytest.mark.parametrize("value_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("dtype", TOPK_DTYPES)
def test_topk_with_residual_matches_the_cpu_kernel_over_steps(dtype, value_dtype):
    gen = torch.Generator().manual_seed(7)
    n, k = 300_001, 3000
    residual, gresidual = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype, device=DEVICE)
    for _ in range(3):
        grad = random_input(n, dtype, gen, special=False)
        values, indices = compress.topk_with_residual(grad, residual, k, value_dtype)
        gvalues, gindices = rc_cuda.topk_with_residual(grad.to(DEVICE), gresidual, k, value_dtype)
        assert torch.equal(gindices.cpu(), indices)
        assert same_bits(gvalues, values)
        assert same_bits(gresidual, residual)


def test_topk_with_residual_k_zero_accumulates():
    grad = torch.randn(1000, device=DEVICE)
    residual = torch.randn(1000, device=DEVICE)
    expect = residual + grad
    values, indices = rc_cuda.topk_with_residual(grad, residual, 0)
    assert values.numel() == 0 and torch.equal(residual, expect)


def test_scatter_add_and_bad_indices():
    out = torch.zeros(100, device=DEVICE)
    indices = torch.tensor([3, 50, 99], dtype=torch.int32, device=DEVICE)
    rc_cuda.scatter_add_(out, indices, torch.tensor([1.0, 2.0, 3.0], device=DEVICE))
    rc_cuda.scatter_add_(out, indices, torch.tensor([1.0, 1.0, 1.0], device=DEVICE))
    assert out[[3, 50, 99]].tolist() == [2.0, 3.0, 4.0] and out.sum().item() == 9.0
    with pytest.raises(ValueError, match="outside"):
        rc_cuda.scatter_add_(
            out, torch.tensor([100], dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE)
        )
    assert out.sum().item() == 9.0


@pytest.fixture(params=["cpp", "python"])
def list_reader(request, monkeypatch):
    """Which reader of tensor lists pack and unpack use: the torch module's (built here if need
    be) or the Python one."""
    module = ringcomm.backend.load() if request.param == "cpp" else None
    monkeypatch.setattr(fusion, "torch_module", lambda: module)
    return module


@pytest.mark.parametrize("wire", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_unpack_match_the_cpu_kernels(wire, list_reader):
    gen = torch.Generator().manual_seed(9)
    # More tensors than one launch carries, some empty, odd sizes.
    sizes = [int(s) for s in torch.randint(0, 5000, (300,), generator=gen)]
    tensors = [torch.randn(s, generator=gen) for s in sizes]
    gtensors = [t.to(DEVICE) for t in tensors]
    total = sum(sizes)
    cpu_flat = torch.empty(total, dtype=wire)
    ptrs, counts = [t.data_ptr() for t in tensors], sizes
    _C.pack_kernel(0, ptrs, counts, 0, total, cpu_flat.data_ptr(), TORCH_DTYPES[wire], 1, 0.25)
    flat = rc_cuda.pack(gtensors, dtype=wire, scale=0.25)
    assert same_bits(flat, cpu_flat)
    rc_cuda.unpack(flat, gtensors, divide=3.0)
    _C.unpack_kernel(cpu_flat.data_ptr(), TORCH_DTYPES[wire], 0, ptrs, counts, 0, total, 2, 3.0)
    for g, t in zip(gtensors, tensors):
        assert same_bits(g, t)


def test_pack_plain_copy_of_integers(list_reader):
    tensors = [torch.arange(n, dtype=torch.int64, device=DEVICE) for n in (5, 0, 1000)]
    flat = rc_cuda.pack(tensors)
    assert torch.equal(flat, torch.cat(tensors))
    back = [torch.empty_like(t) for t in tensors]
    rc_cuda.unpack(flat, back)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_pack_lists_read_alike_and_bad_items_named(list_reader):
    tensors = [torch.arange(n, dtype=torch.float32, device=DEVICE) for n in (3, 0, 700)]
    if list_reader is not None:
        read = [
            memoryview(b).cast("Q").tolist()
            for b in list_reader.tensor_lists(tensors, str(tensors[0].device))
        ]
        assert read == [[t.data_ptr() for t in tensors], [3, 0, 700], [0, 0, 0]]
        assert list_reader.tensor_lists(tensors, "cpu") is None
    assert torch.equal(rc_cuda.pack(tensors), torch.cat(tensors))
    for bad, error, why in (
        (torch.ones(2, dtype=torch.float64, device=DEVICE), TypeError, "dtype"),
        (torch.ones(2), ValueError, "CUDA tensor"),
        (torch.ones(4, 4, device=DEVICE).t(), ValueError, "contiguous"),
    ):
        with pytest.raises(error, match=rf"tensors\[1\] .*{why}"):
            rc_cuda.pack([tensors[0], bad, tensors[2]])
        with pytest.raises(error, match=rf"tensors\[1\] .*{why}"):
            rc_cuda.unpack(torch.empty(703, device=DEVICE), [tensors[0], bad, tensors[2]])


def test_kernels_follow_the_current_stream():
    x = torch.randn(1 << 22, device=DEVICE)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the result is only right if reduce_ waits behind this
        y = x * 2
        rc_cuda.reduce_(out, y, x, "sum")
    side.synchronize()
    assert torch.equal(out, x * 2 + x)
