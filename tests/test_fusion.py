"""Coalesced collectives, pack/unpack kernels and GradientAverager.

"Equal" below is bitwise: floats are compared through their integer bit patterns, so -0.0 vs 0.0
and the last bit of a rounding count. Inputs are finite.
"""

import json
import os
import statistics
from array import array

import numpy as np
import pytest
import torch

import ringcomm
from ringcomm import _C
from ringcomm._buffers import TORCH_DTYPES
from ranks import run_ranks

pytestmark = pytest.mark.every_transport  # once per transport (conftest.py)

BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
SCALE_NONE, SCALE_MULTIPLY, SCALE_DIVIDE = 0, 1, 2


def bits(t):
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---- kernels ------------------------------------------------------------------------------


def ptrs_counts(tensors):
    return [t.data_ptr() for t in tensors], [t.numel() for t in tensors]


def random_list(dtype, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.randint(0, 2, (n,), generator=gen).bool() for n in sizes]
    if dtype.is_floating_point:
        return [
            (torch.randn(n, generator=gen, dtype=torch.float64) * 1000).to(dtype) for n in sizes
        ]
    return [torch.randint(-1000, 1000, (n,), generator=gen).to(dtype) for n in sizes]


def torch_convert(x, dst, kind, factor):
    """What the kernels promise: compute in float32 (float64 for float64), scale, round once."""
    compute = torch.float64 if torch.float64 in (x.dtype, dst) else torch.float32
    if kind == SCALE_NONE:
        return x.to(dst)
    v = x.to(compute)
    v = v * factor if kind == SCALE_MULTIPLY else v / factor
    return v.to(dst)


FLOAT_CONVERSIONS = [
    (torch.float32, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
]
SCALINGS = [(SCALE_NONE, 1.0), (SCALE_MULTIPLY, 0.37), (SCALE_DIVIDE, 3.0)]


@pytest.mark.parametrize(
    "src,dst,kind,factor",
    [c + s for c in FLOAT_CONVERSIONS for s in SCALINGS]
    + [(t, t, SCALE_NONE, 1.0) for t in (torch.int32, torch.bool, torch.uint8)],
)
@pytest.mark.transport_fixed
def test_pack_and_unpack_match_torch(src, dst, kind, factor):
    sizes = [5, 0, 1, 1000, 0, 37, 4099]
    tensors = random_list(src, sizes, seed=len(sizes) + kind)
    flat = torch.cat(tensors)
    ptrs, counts = ptrs_counts(tensors)
    for begin, end in [(0, flat.numel()), (3, 1040), (1006, 1006), (1005, 1007), (1043, 5142)]:
        packed = torch.empty(end - begin, dtype=dst)
        _C.pack_kernel(
            TORCH_DTYPES[src],
            ptrs,
            counts,
            begin,
            end,
            packed.data_ptr(),
            TORCH_DTYPES[dst],
            kind,
            factor,
        )
        assert same(packed, torch_convert(flat[begin:end], dst, kind, factor)), (begin, end)
        # unpack the other way into a copy of the list: only [begin, end) changes
        targets = [t.clone() for t in tensors]
        source = random_list(dst, [end - begin], seed=begin)[0]
        _C.unpack_kernel(
            source.data_ptr(),
            TORCH_DTYPES[dst],
            TORCH_DTYPES[src],
            *ptrs_counts(targets),
            begin,
            end,
            kind,
            factor,
        )
        expect = flat.clone()
        expect[begin:end] = torch_convert(source, src, kind, factor)
        assert same(torch.cat(targets), expect), (begin, end)


@pytest.mark.transport_fixed
@pytest.mark.parametrize("nbytes", [1, 255, 256, 257, 287, 383, 384, 4096 + 97])
def test_plain_copies_at_every_alignment_of_source_and_destination(nbytes):
    # Same-dtype packs and unpacks are the kernels' own vector copies from 256 bytes on: every
    # source and destination offset modulo 64, with the bytes around the destination untouched.
    gen = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (nbytes + 64,), generator=gen).to(torch.uint8)
    u8 = TORCH_DTYPES[torch.uint8]
    for s in range(0, 64, 3):
        piece = src[s : s + nbytes]
        for d in range(0, 64, 5):
            out = torch.full((nbytes + 128,), 0xAB, dtype=torch.uint8)
            _C.pack_kernel(
                u8, [piece.data_ptr()], [nbytes], 0, nbytes, out.data_ptr() + d, u8, SCALE_NONE, 1.0
            )
            assert torch.equal(out[d : d + nbytes], piece), (s, d)
            assert bool((out[:d] == 0xAB).all()) and bool((out[d + nbytes :] == 0xAB).all()), (s, d)
            back = torch.full((nbytes + 128,), 0xCD, dtype=torch.uint8)
            _C.unpack_kernel(
                out.data_ptr() + d,
                u8,
                u8,
                [back.data_ptr() + s],
                [nbytes],
                0,
                nbytes,
                SCALE_NONE,
                1.0,
            )
            assert torch.equal(back[s : s + nbytes], piece), (s, d)
            assert bool((back[:s] == 0xCD).all()) and bool((back[s + nbytes :] == 0xCD).all())


@pytest.mark.transport_fixed
def test_fp16_packing_rounds_once_over_all_values():
    # Every fp16 value, widened, scaled by 1/3 and packed back to fp16, against torch's rounding.
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = h[~h.isnan()]
    src = h.float()
    out = torch.empty_like(h)
    _C.pack_kernel(
        TORCH_DTYPES[torch.float32],
        [src.data_ptr()],
        [src.numel()],
        0,
        src.numel(),
        out.data_ptr(),
        TORCH_DTYPES[torch.float16],
        SCALE_MULTIPLY,
        1 / 3,
    )
    assert same(out, (src * (1 / 3)).half())


@pytest.mark.transport_fixed
def test_kernel_argument_errors():
    a = torch.zeros(4, dtype=torch.float64)
    out = torch.empty(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot convert float64 to float16"):
        _C.pack_kernel(
            TORCH_DTYPES[torch.float64],
            [a.data_ptr()],
            [4],
            0,
            4,
            out.data_ptr(),
            TORCH_DTYPES[torch.float16],
            SCALE_NONE,
            1.0,
        )
    i = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="scaling needs floating"):
        _C.pack_kernel(
            TORCH_DTYPES[torch.int32],
            [i.data_ptr()],
            [4],
            0,
            4,
            i.data_ptr(),
            TORCH_DTYPES[torch.int32],
            SCALE_MULTIPLY,
            2.0,
        )
    with pytest.raises(ValueError, match="outside a list of 4"):
        _C.pack_kernel(
            TORCH_DTYPES[torch.int32],
            [i.data_ptr()],
            [4],
            0,
            5,
            i.data_ptr(),
            TORCH_DTYPES[torch.int32],
            SCALE_NONE,
            1.0,
        )


# ---- all_reduce_coalesced = per-tensor all_reduce ------------------------------------------


def mixed_tensors(rank, seed):
    """Mixed dtypes, shapes and sizes (zero-size and 0-d included), with magnitudes spread so that
    the order of float additions shows in the last bits."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)

    def floats(shape, dtype, spread=4.0):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        return (x * torch.exp(torch.randn(shape, generator=gen, dtype=torch.float64) * spread)).to(
            dtype
        )

    return [
        floats((3,), torch.float32),
        floats((0,), torch.float32),
        floats((17, 5), torch.float64),
        floats((9000,), torch.float32),  # 36 KB: ring under the link model used below
        floats((4, 0, 3), torch.float16),
        floats((), torch.float32),
        floats((2000,), torch.bfloat16, 1.0),
        floats((301,), torch.float16, 1.0),
        torch.randint(-(2**31), 2**31 - 1, (1500,), generator=gen, dtype=torch.int64).to(
            torch.int32
        ),
        torch.randint(0, 2, (77,), generator=gen).bool(),
        floats((64, 64), torch.float32),
        torch.randint(-100, 100, (50,), generator=gen).to(torch.int8),
    ]


def coalesced_equals_per_tensor(comm, ops, bucket_sizes):
    r = comm.rank
    checked = 0
    for seed, op in enumerate(ops):
        for bucket_bytes in bucket_sizes:
            tensors = [
                t for t in mixed_tensors(r, seed) if op != "avg" or t.dtype.is_floating_point
            ]
            expect = [t.clone() for t in tensors]
            for t in expect:
                comm.all_reduce(t, op=op)
            assert comm.all_reduce_coalesced(tensors, op=op, bucket_bytes=bucket_bytes) is None
            for i, (got, want) in enumerate(zip(tensors, expect)):
                assert same(got, want), (
                    f"op {op}, bucket_bytes {bucket_bytes}, tensor {i} {got.dtype}"
                )
                checked += 1
    # Not vacuous: a fused bucket reduced by one ring all-reduce (not in each tensor's own order)
    # gives other bits than one all_reduce per tensor.
    tensors = [t.reshape(-1) for t in mixed_tensors(r, 0) if t.dtype == torch.float32]
    expect = [t.clone() for t in tensors]
    for t in expect:
        comm.all_reduce(t)
    fused = torch.cat(tensors)
    comm.all_reduce(fused, algorithm="ring")
    return checked, same(fused, torch.cat(expect))


# Under auto, with this link model (a round worth 512 bytes), tensors up to 2 KiB go by recursive
# doubling and larger ones by halving-doubling at 4 ranks (up to 307 bytes at 3, then by ring);
# tiny slices (256 B) give many slices per bucket and slices that cross bucket edges. No boards:
# the shared buffer's two rounds would take every size up to a board-full under this model.
SMALL = {
    "RINGCOMM_TUNING": os.path.join(os.path.dirname(__file__), "small_messages.tuning"),
    "RINGCOMM_FUSION_SLICE_BYTES": "256",
    "RINGCOMM_SHM_BOARD_BYTES": "0",
}


# auto at 3 ranks: recursive doubling with a fold, ring; at 4: recursive doubling and
# halving-doubling without a fold. Forced trees at 3 and 5 ranks: heaps with one and two levels
# below the root; halving-doubling at 6: with a fold; the shared buffer at 3 and 4, over many
# rounds of a 64 KiB board.
@pytest.mark.parametrize(
    "world,algo",
    [
        (2, "auto"),
        (3, "auto"),
        (4, "auto"),
        (3, "tree"),
        (5, "tree"),
        (6, "recursive_doubling"),
        (6, "halving_doubling"),
        (3, "shared_buffer"),
        (4, "shared_buffer"),
    ],
)
def test_all_reduce_coalesced_is_bitwise_per_tensor_all_reduce(world, algo, transport):
    env = dict(SMALL, RINGCOMM_ALGO=algo)
    if algo == "shared_buffer":
        if transport != "shm":
            pytest.skip("the shared buffer runs only where every rank is in shared memory")
        env["RINGCOMM_SHM_BOARD_BYTES"] = "65536"
    results = run_ranks(
        world,
        coalesced_equals_per_tensor,
        ["sum", "avg", "prod", "max"],
        [25 << 20, 1000],
        env=env,
        timeout=120,
    )
    for checked, naive_fusion_equal in results:
        assert checked == 4 * 2 * 12 - 2 * 3  # avg skips the three integer tensors
        # with two ranks every order is one addition, so only from three ranks on does it show
        assert naive_fusion_equal == (world == 2)


def orders_grow_under_a_running_call(comm):
    # The communicator builds reduction orders as calls first need them: the first call needs
    # recursive doubling's only (tensors of at most 307 bytes under SMALL at 3 ranks), the next
    # ring's too, and is planned while the first may still be running on its snapshot.
    gen = torch.Generator().manual_seed(comm.rank)
    first = [torch.randn(50, generator=gen) * 1e3 for _ in range(400)]
    second = [torch.randn(20, generator=gen), torch.randn(5000, generator=gen) * 1e-3]
    expect = [t.clone() for t in first + second]
    for t in expect:
        comm.all_reduce(t)
    works = [
        comm.all_reduce_coalesced(first, async_op=True),
        comm.all_reduce_coalesced(second, async_op=True),
    ]
    for w in works:
        w.wait()
    return (
        comm.algorithm_for(50 * 4),
        comm.algorithm_for(5000 * 4),
        all(same(a, b) for a, b in zip(first + second, expect)),
    )


def test_reduction_orders_grow_under_a_running_call():
    for small, large, equal in run_ranks(3, orders_grow_under_a_running_call, env=SMALL):
        assert (small, large, equal) == ("recursive_doubling", "ring", True)


def coalesced_under_default_knobs(comm):
    r = comm.rank
    tensors = mixed_tensors(r, 5)
    expect = [t.clone() for t in tensors]
    for t in expect:
        comm.all_reduce(t)
    comm.all_reduce_coalesced(tensors)
    return all(same(a, b) for a, b in zip(tensors, expect))


# ---- through the boards: each element still in its own tensor's order ----------------------

ALGORITHMS = ["ring", "recursive_doubling", "tree", "halving_doubling", "shared_buffer"]
MEASURED = [4096, 65536, 262144, 1048576, 4194304, 16777216]


def boards_from_256k(path):
    """SMALL's link model pinned with measured factors: the shared buffer 1000x its estimate up to
    64 KiB and 0.001x from 256 KiB, every other algorithm as estimated. Tensors of a few KiB go
    by the ring (3 ranks), a bucket of 256 KiB or more by the shared buffer."""
    with open(SMALL["RINGCOMM_TUNING"]) as f:
        lines = f.read().splitlines()
    for algo in ALGORITHMS:
        for size in MEASURED:
            factor = 1 if algo != "shared_buffer" else (1000 if size <= 65536 else 0.001)
            lines.append(f"factor {algo} {size} {factor}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def coalesced_through_boards(comm, path):
    from ringcomm import trace

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(comm.rank)

    def spread(n, dtype=torch.float32):  # magnitudes spread: each order shows in the last bits
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        return (x * torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * 4)).to(dtype)

    ran, equal = [], []
    # 60 KB buckets: a flat all-reduce of one would go by the ring under this model, and the
    # call still takes the boards
    calls = [
        ("sum", 25 << 20),
        ("prod", 25 << 20),
        ("max", 25 << 20),
        ("sum", 270_000),
        ("sum", 60_000),
        ("avg", 25 << 20),
    ]
    for i, (op, bucket_bytes) in enumerate(calls):
        # 100 tensors of 2.8 KB (the ring's each), spaced apart, and others of three dtypes
        tensors = [spread(700) for _ in range(100)] + [
            spread(3),
            torch.zeros(0),
            spread(5000),
            spread(300, torch.float64),
            torch.randint(-9, 9, (40,), generator=gen),
        ]
        if op == "avg":
            tensors = tensors[:-1]
        expect = [t.clone() for t in tensors]
        for t in expect:
            comm.all_reduce(t, op=op)
        trace.start(f"{path}.{i}")
        comm.all_reduce_coalesced(tensors, op=op, bucket_bytes=bucket_bytes)
        trace.stop()
        with open(f"{path}.{i}.rank{comm.rank}.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        (call,) = [e for e in events if e["name"] == "all_reduce_coalesced"]
        ran.append((call["args"]["algorithm"], sum(e["name"] == "board-in" for e in events) > 0))
        equal.append(all(same(a, b) for a, b in zip(tensors, expect)))
    # Not vacuous: the shared buffer's rank order over the fused float32 bytes gives other bits.
    tensors = [spread(700) for _ in range(100)]
    expect = [t.clone() for t in tensors]
    for t in expect:
        comm.all_reduce(t)
    fused = torch.cat(tensors)
    comm.all_reduce(fused, algorithm="shared_buffer")
    # Ranks that pass the same bytes in other tensors disagree on the first bucket's first
    # message, on the boards as in the pipeline.
    odd = comm.rank % 2
    try:
        comm.all_reduce_coalesced(
            [spread(70000 if odd else 30000), spread(30000 if odd else 70000)]
        )
        mismatch = "no error"
    except ringcomm.RingcommError as e:
        mismatch = str(e)
    return (
        ran,
        equal,
        same(fused, torch.cat(expect)),
        comm.algorithm_for(2800),
        comm.algorithm_for(60_000),
        mismatch,
    )


def test_coalesced_buckets_through_the_boards_keep_each_tensors_order(tmp_path, transport):
    if transport != "shm":
        pytest.skip("the boards are shared memory's")
    env = {
        "RINGCOMM_TUNING": boards_from_256k(tmp_path / "model"),
        "RINGCOMM_SHM_BOARD_BYTES": "65536",
    }  # 10.9 KB slots: 30 rounds and more a bucket
    for ran, equal, fused_equal, small, bucket, mismatch in run_ranks(
        3, coalesced_through_boards, str(tmp_path / "t"), env=env, timeout=120
    ):
        assert small == bucket == "ring"
        # sum, prod and max through the boards, in one bucket, two, or buckets a flat all-reduce
        # would send by the ring; avg is scaled on the way out, so it goes through the pipeline
        assert ran == [("shared_buffer", True)] * 5 + [("direct", False)]
        assert equal == [True] * 6
        assert not fused_equal
        assert "mismatched operations" in mismatch, mismatch


def test_all_reduce_coalesced_default_knobs():
    assert all(run_ranks(3, coalesced_under_default_knobs))


def many_tiny_tensors(comm):
    sizes = torch.randint(1, 17, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = torch.Generator().manual_seed(comm.rank)
    dtypes = [torch.float32, torch.float16, torch.float64, torch.int64]
    tensors = [(torch.randn(n, generator=gen) * 10).to(dtypes[i % 4]) for i, n in enumerate(sizes)]
    expect = [t.clone() for t in tensors]
    for t in expect:
        comm.all_reduce(t)
    work = comm.all_reduce_coalesced(tensors, bucket_bytes=4096, async_op=True)
    assert work.get_future().wait() is tensors
    return all(same(a, b) for a, b in zip(tensors, expect))


def test_1000_tiny_tensors():
    assert all(run_ranks(3, many_tiny_tensors))


def replanned_when_anything_changes(comm, change):
    # The communicator keeps its last few plans and reuses one for a call with the same buffers
    # and options; each call below changes one thing the plan depends on and keeps the
    # addresses, so a plan reused where it should not be gives wrong results.
    r, n = comm.rank, comm.world_size
    base = torch.arange(4000, dtype=torch.float32)
    a, b = torch.zeros(3000), torch.zeros(1000)

    def fill():
        for t, v in zip((a, b), (base[:3000], base[3000:])):
            t.copy_(v * (r + 1))

    def call(tensors, **kw):
        fill()
        comm.all_reduce_coalesced(tensors, **kw)

    total = n * (n + 1) / 2
    call([a, b])
    call([a, b])  # the same list: the plan is reused
    assert torch.equal(a, base[:3000] * total) and torch.equal(b, base[3000:] * total)
    call([a[:1000], b])  # the same addresses, fewer elements
    assert torch.equal(a[:1000], base[:1000] * total)
    assert torch.equal(a[1000:], base[1000:3000] * (r + 1))
    call([a[:1000], b], op="max")
    assert torch.equal(a[:1000], base[:1000] * n) and torch.equal(b, base[3000:] * n)
    call([a[:1000], b], op="max", bucket_bytes=1000)
    assert torch.equal(b, base[3000:] * n)
    c, d = torch.zeros(1000), base[3000:] * (r + 1)  # other addresses, the same sizes
    c.copy_(base[:1000] * (r + 1))
    call([a[:1000], b])
    comm.all_reduce_coalesced([c, d])
    assert torch.equal(c, base[:1000] * total) and torch.equal(d, base[3000:] * total)
    call([a[:1000], b])
    call([a.view(torch.int32)[:1000], b])  # another dtype at the same address
    want = (base[:1000] * (r + 1)).view(torch.int32).clone()
    comm.all_reduce(want)
    assert torch.equal(a.view(torch.int32)[:1000], want)
    f32, f16 = TORCH_DTYPES[torch.float32], TORCH_DTYPES[torch.float16]
    bufs = [a, b]
    for wire, prescale in ((f32, 1.0), (f32, 0.5), (f16, 0.5)):  # the core call's options
        fill()
        _C.all_reduce_coalesced(
            comm._core,
            array("Q", [t.data_ptr() for t in bufs]),
            array("Q", [t.numel() for t in bufs]),
            array("Q", [f32, f32]),
            0,
            1 << 20,
            wire,
            prescale,
            False,
        )
        exact = base[:3000] * total * prescale
        if wire == f32:
            assert torch.equal(a, exact)
        else:  # float16 keeps 11 bits: the larger sums are rounded
            assert not torch.equal(a, exact) and torch.allclose(a, exact, rtol=2**-10)
    # More lists than the plans kept, in turn: (the list, a tensor of it, its values)
    calls = [
        ([a, b], a, base[:3000]),
        ([c, d], c, base[:1000]),
        ([a[:500], b], a[:500], base[:500]),
        ([a[1000:], d], a[1000:], base[1000:3000]),
        ([b], b, base[3000:]),
        ([c], c, base[:1000]),
    ]
    for i in (0, 1, 0, 1, 2, 3, 4, 5, 0, 2, 1, 3):
        for t, v in zip((a, b, c, d), (base[:3000], base[3000:], base[:1000], base[3000:])):
            t.copy_(v * (r + 1))
        tensors, got, values = calls[i]
        comm.all_reduce_coalesced(tensors)
        assert torch.equal(got, values * total), i
    # Rank 1 alone changes its call after two calls alike: both raise, neither reuses its plan.
    call([a, b])
    try:
        if change == "count":
            call([a, b[:999]] if r == 1 else [a, b])
        else:
            call([a, b], bucket_bytes=4000 if r == 1 else 1 << 20)
    except ringcomm.RingcommError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("change", ["count", "bucket_bytes"])
def test_a_repeated_list_reuses_its_plan_and_any_change_is_replanned(change):
    for rank, message in enumerate(
        run_ranks(2, replanned_when_anything_changes, change, timeout=60, comm_timeout=20)
    ):
        assert "mismatched operations" in message, f"rank {rank}: {message}"


# ---- empty lists, async, broadcast, all_gather -------------------------------------------------


def edge_cases(comm):
    r, n = comm.rank, comm.world_size
    assert comm.all_reduce_coalesced([]) is None
    assert comm.broadcast_coalesced((), src=0) is None
    work = comm.all_reduce_coalesced([], async_op=True)
    assert work.wait() and work.is_completed() and work.get_future().wait() == []
    empties = [torch.empty(0), torch.empty(0, 4, dtype=torch.int64)]
    comm.all_reduce_coalesced(empties)  # buckets with no elements still travel and are checked
    comm.broadcast_coalesced(empties, src=n - 1)
    outs = [[torch.empty(0), torch.empty(0, 4, dtype=torch.int64)] for _ in range(n)]
    comm.all_gather_coalesced(outs, empties)
    # numpy arrays work too
    arrays = [np.full(5, r + 1.0), np.arange(3, dtype=np.int32) * (r + 1)]
    comm.all_reduce_coalesced(arrays, op="max")
    assert (arrays[0] == n).all() and (arrays[1] == np.arange(3) * n).all()
    # several async calls of different kinds, queued back to back, finish in order
    a = [torch.full((10,), float(r))]
    b = [torch.full((100_000,), float(r + 1))]
    works = [
        comm.all_reduce_coalesced(a, op="avg", async_op=True),
        comm.broadcast_coalesced(b, src=0, async_op=True),
        comm.all_reduce_coalesced(b, bucket_bytes=1 << 16, async_op=True),
    ]
    for w in works:
        w.wait()
    assert (a[0] == (n - 1) / 2).all() and (b[0] == n).all()
    return True


def test_empty_lists_zero_size_numpy_and_async():
    assert all(run_ranks(3, edge_cases))


def rooted_and_gathered(comm):
    r, n = comm.rank, comm.world_size
    assert coalesced_under_default_knobs(comm)  # with one rank too: the tensors stay as they are
    for root in range(n):
        for bucket_bytes in (25 << 20, 300):
            mine = mixed_tensors(r, 7)
            comm.broadcast_coalesced(mine, src=root, bucket_bytes=bucket_bytes)
            assert all(same(a, b) for a, b in zip(mine, mixed_tensors(root, 7))), (
                root,
                bucket_bytes,
            )
    big = [torch.full((300_000,), float(r)), torch.arange(70_000) + r]  # chain-shaped broadcast
    comm.broadcast_coalesced(big, src=n - 1)
    assert (big[0] == n - 1).all() and torch.equal(big[1], torch.arange(70_000) + n - 1)
    inputs = mixed_tensors(r, 8)
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(n)]
    comm.all_gather_coalesced(outputs, inputs, bucket_bytes=500)
    for q in range(n):
        assert all(same(a, b) for a, b in zip(outputs[q], mixed_tensors(q, 8))), q
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_broadcast_and_all_gather_coalesced(world):
    assert all(run_ranks(world, rooted_and_gathered, env={"RINGCOMM_FUSION_SLICE_BYTES": "4096"}))


# ---- mismatches are detected, not hung on ---------------------------------------------------


def mismatched(comm, kind):
    odd = comm.rank == 1
    if kind == "sizes":  # same total, different split: the layout hash differs
        call = lambda: comm.all_reduce_coalesced(
            [torch.ones(3 if odd else 5), torch.ones(5 if odd else 3)]
        )
    elif kind == "more_tensors":  # the first bucket alike, one more bucket on rank 1
        call = lambda: comm.all_reduce_coalesced(
            [torch.ones(10)] + ([torch.ones(10, dtype=torch.float64)] if odd else [])
        )
    elif kind == "plain":
        call = (
            (lambda: comm.all_reduce(torch.ones(8)))
            if odd
            else (lambda: comm.all_reduce_coalesced([torch.ones(8)]))
        )
    else:  # bucket_bytes differ
        call = lambda: comm.all_reduce_coalesced([torch.ones(100)], bucket_bytes=40 if odd else 400)
    comm.all_reduce_coalesced([torch.ones(5)])
    try:
        call()
    except ringcomm.RingcommError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind", ["sizes", "more_tensors", "plain", "bucket_bytes"])
def test_mismatched_coalesced_calls_raise_on_every_rank(kind):
    for rank, message in enumerate(run_ranks(2, mismatched, kind, timeout=60, comm_timeout=20)):
        assert "mismatched operations" in message, f"rank {rank}: {message}"
        assert "all_reduce_coalesced(seq=1" in message, message


# ---- GradientAverager vs DDP on scikit-learn's digits ---------------------------------------


def averager_vs_ddp(store, rank, world, compression, bucket_bytes):
    from datetime import timedelta

    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("gloo", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    comm = ringcomm.Communicator(dist.PrefixStore("ringcomm", store), rank, world, timeout=30)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(64, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 10),
        )

    ours = model()
    theirs = DDP(model(), bucket_cap_mb=1)
    local = model()  # this rank's own gradients, for the rounding bound below
    theirs.module.load_state_dict(ours.state_dict())
    local.load_state_dict(ours.state_dict())
    averager = ringcomm.GradientAverager(
        ours.parameters(), comm, bucket_bytes=bucket_bytes, compression=compression
    )
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.5)
    # Rounding bound of a compressed average: each g_r / n is rounded once when packed, each sum
    # once, so |error| <= 2 u mean_r |g_r| (u: the format's unit roundoff), plus the spacing of
    # float16's subnormals.
    u, tiny = {None: (0.0, 0.0), "fp16": (2.0**-11, 2.0**-24), "bf16": (2.0**-8, 0.0)}[compression]
    worst, launched_in_backward = 0.0, []
    for step in range(6):
        batch = slice(step * 128 + rank * 64, step * 128 + rank * 64 + 64)  # each rank its own
        for net in (ours, theirs, local):
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
        launched_in_backward.append(averager.launched)
        averager.step()
        magnitude = [p.grad.abs() / world for p in local.parameters()]
        for m in magnitude:
            comm.all_reduce(m)  # mean over ranks of |g_r|
        for a, b, m in zip(ours.parameters(), theirs.parameters(), magnitude):
            if compression is None:
                assert same(a.grad, b.grad), f"step {step}: gradients differ"
            bound = 2 * u * m + 2 * tiny + 1e-7 * b.grad.abs()  # DDP's own float32 rounding
            worst = max(worst, float(((a.grad - b.grad).abs() / bound.clamp_min(1e-30)).max()))
        optimizer.step()
        theirs.module.load_state_dict(ours.state_dict())  # compare the next step at equal weights
        local.load_state_dict(ours.state_dict())
    comm.close()
    dist.destroy_process_group()
    return worst, launched_in_backward, len(averager.buckets)


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_gradient_averager_matches_ddp_on_digits(compression):
    results = run_ranks(2, averager_vs_ddp, compression, 2048, make_comm=False, timeout=120)
    for worst, launched_in_backward, buckets in results:
        assert buckets > 2
        # the hooks started every bucket during backward
        assert launched_in_backward == [buckets] * len(launched_in_backward)
        # None: bitwise (asserted inside); compressed: within the rounding bound of DDP's average
        assert worst <= 1.0, worst


def averager_details(comm):
    lin = torch.nn.Linear(4, 3)
    extra = torch.nn.Parameter(torch.ones(5))
    averager = ringcomm.GradientAverager(
        [lin.weight, lin.bias, lin.weight, extra], comm, bucket_bytes=16
    )
    assert [len(b) for b in averager.buckets] == [1, 1, 1]  # weight listed twice counts once
    lin(torch.full((2, 4), float(comm.rank))).sum().backward()  # extra gets no gradient
    averager.step()
    n = comm.world_size
    assert torch.equal(extra.grad, torch.zeros(5))
    assert torch.allclose(lin.weight.grad, torch.full((3, 4), 2.0 * (n - 1) / 2))
    # gradient accumulation: no_sync, then a last backward outside it
    for p in lin.parameters():
        p.grad = None
    with averager.no_sync():
        lin(torch.ones(1, 4)).sum().backward()
    assert averager.launched == 0
    lin(torch.ones(1, 4)).sum().backward()
    averager.step()
    assert torch.allclose(lin.bias.grad, torch.full((3,), 2.0))
    # a second backward without step() would race with a bucket on the wire
    lin(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="accumulated twice"):
        lin(torch.ones(1, 4)).sum().backward()
    averager.step()
    averager.remove()
    return True


def test_gradient_averager_details():
    assert all(run_ranks(2, averager_details))


@pytest.mark.transport_fixed
def test_gradient_averager_arguments():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match="compression must be None, 'fp16', 'bf16' or a ringcomm.compress.Compressor",
    ):
        ringcomm.GradientAverager(lin.parameters(), None, compression="topk")
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        ringcomm.GradientAverager([lin.weight * 2], None)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        ringcomm.GradientAverager(lin.parameters(), None, bucket_bytes=-1)


# ---- the benchmark's coalesced mode -----------------------------------------------------------


@pytest.mark.transport_fixed
def test_bench_coalesced_mode_checks_results(tmp_path):
    import json
    import subprocess
    import sys

    out_file = tmp_path / "coalesced.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "--coll",
        "all_reduce_coalesced",
        "--tensors",
        "50",
        "--tensor-bytes",
        "4-2K",
        "-n",
        "2",
        "-w",
        "1",
        "--repeats",
        "3",
        "--compare",
        "gloo,backend",
        "--floor",
        "--json",
        str(out_file),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out_file.read_text())["rows"]
    variants = [
        "ringcomm all_reduce_coalesced",
        "ringcomm coalesced, views of one buffer",
        "ringcomm all_reduce per tensor",
        "gloo all_reduce_coalesced",
        "backend all_reduce_coalesced",
        "backend all_reduce, one flat tensor",
        "ringcomm all_reduce, one flat tensor",
    ]
    for name in variants:
        assert name in run.stdout
        assert row[name]["wrong"] == 0 and len(row[name]["samples_us"]) == 3
    assert row[variants[0]]["ratio"] == 1.0
    assert "# tensor lists read in C++" in run.stdout  # the backend's use has loaded the module
    # --floor: the flat all_reduce + reading the list + what the layout adds to 2 passes
    limit = row["layout limit"]
    passes = limit["passes_us"]
    assert len(passes) == 2 and all(len(v) == 3 for v in limit["passes_samples_us"].values())
    flat = row["ringcomm all_reduce, one flat tensor"]["time_us"]
    flat_then_list = limit["flat_then_list_samples_us"]
    assert len(flat_then_list) == 3
    flat_alone = row["ringcomm all_reduce, one flat tensor"]["samples_us"]
    assert limit["list_read_us"] == pytest.approx(  # repeat by repeat
        statistics.median(then - alone for then, alone in zip(flat_then_list, flat_alone))
    )
    assert limit["time_us"] == pytest.approx(
        flat
        + limit["list_read_us"]
        + passes["pack + unpack of the tensors, no exchange"]
        - passes["pack + unpack of the views, no exchange"]
    )
    assert limit["coalesced_over_limit"] == pytest.approx(
        row[variants[0]]["time_us"] / limit["time_us"]
    )
    assert (
        "# layout limit = flat all_reduce + the list + tensors' passes - views' passes"
        in run.stdout
    )


@pytest.mark.transport_fixed
def test_layout_passes_read_and_write_every_element():
    # Two messages' worth (RINGCOMM_FUSION_SLICE_BYTES each) in four tensors: every element is
    # packed into the one staging buffer, then every element unpacked from it, so both halves end
    # up holding the second half's values; then the argument checks.
    from ringcomm.fusion import BufferList

    half = int(os.environ.get("RINGCOMM_FUSION_SLICE_BYTES") or 128 << 10) // 4
    tensors = random_list(torch.float32, [3, 0, half - 3 + 1000, half - 1000], seed=5)
    second = torch.cat(tensors)[half:].clone()
    lists = BufferList(tensors)
    _C.layout_passes(lists.ptrs, lists.counts, lists.dtypes)
    after = torch.cat(tensors)
    assert same(after[:half], second) and same(after[half:], second)
    mixed = BufferList([torch.ones(4), torch.ones(4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="buffers of one dtype"):
        _C.layout_passes(mixed.ptrs, mixed.counts, mixed.dtypes)
    empty = array("Q")
    with pytest.raises(ValueError, match="at least one buffer"):
        _C.layout_passes(empty, empty, empty)


def scratch_held(comm):
    comm.all_reduce_coalesced([torch.ones(10) for _ in range(20)])
    after_tiny = comm.scratch_bytes
    comm.all_reduce(torch.ones(4 << 20), algorithm="ring")
    after_big = comm.scratch_bytes
    for _ in range(2 * 64):  # two trim periods of small calls
        comm.all_reduce(torch.ones(10))
    return after_tiny, after_big, comm.scratch_bytes


def test_scratch_memory_follows_what_calls_need():
    """Tiny buckets reserve tiny buffers (not a 3-deep pipeline of 128 KiB slices: 1.5 MiB at 2
    ranks), and what one 16 MiB call needed is given back once later calls need less."""
    for tiny, big, trimmed in run_ranks(2, scratch_held):
        assert tiny < 32 << 10, tiny  # the reduction-order replay's 16 KiB block, and the slice
        assert big >= 4 << 20, big
        assert trimmed < 64 << 10, trimmed


def bitwise_coalesced(comm):
    ts = [
        torch.tensor([5, 3 + comm.rank], dtype=torch.int32),
        torch.tensor([True, comm.rank == 0]),
        torch.arange(4, dtype=torch.uint8) * (comm.rank + 1),
    ]
    comm.all_reduce_coalesced(ts, op="bxor")
    try:
        comm.all_reduce_coalesced([torch.ones(2, dtype=torch.int64), torch.ones(2)], op="bor")
    except ValueError as e:
        return [t.tolist() for t in ts], str(e)
    return [t.tolist() for t in ts], "no error"


def test_bitwise_ops_coalesced():
    for reduced, error in run_ranks(2, bitwise_coalesced):
        assert reduced == [[0, 3 ^ 4], [False, True], [0, 1 ^ 2, 2 ^ 4, 3 ^ 6]]
        assert "needs an integer or bool dtype, got float32" in error
