"""reduce_scatter, all_gather(v), broadcast, reduce, gather, scatter, all_to_all, barrier,
send/recv, async handles."""

import numpy as np
import pytest
import torch

from ranks import run_ranks

pytestmark = pytest.mark.every_transport  # once per transport (conftest.py)

WORLDS = [1, 2, 3, 5]


def values(rank, n, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float64) % 11 + rank * 3 - 4).to(dtype)


def rooted_and_gathers(comm, counts):
    r, n = comm.rank, comm.world_size
    for count in counts:
        # reduce_scatter: tensor input and list input
        inp = values(r, count * n)
        out = torch.empty(count)
        comm.reduce_scatter(out, inp)
        total = sum(values(q, count * n) for q in range(n))
        assert torch.equal(out, total[r * count : (r + 1) * count]), "reduce_scatter"
        out2 = torch.empty(count, dtype=torch.float64)
        comm.reduce_scatter(out2, [values(r, count, torch.float64) + q for q in range(n)], op="max")
        assert torch.equal(out2, values(n - 1, count, torch.float64) + r), "reduce_scatter list max"

        # all_gather into one tensor and into a list
        gathered = torch.empty(count * n, dtype=torch.int64)
        comm.all_gather(gathered, values(r, count, torch.int64))
        assert torch.equal(gathered, torch.cat([values(q, count, torch.int64) for q in range(n)]))
        pieces = [torch.empty(count, dtype=torch.bfloat16) for _ in range(n)]
        comm.all_gather(pieces, values(r, count, torch.bfloat16))
        for q in range(n):
            assert torch.equal(pieces[q], values(q, count, torch.bfloat16)), "all_gather list"

        # all_gatherv with per-rank sizes, including empty contributions
        sizes = [(count + 3 * q) % 5 * (q + 1) for q in range(n)]
        gv = torch.empty(sum(sizes), dtype=torch.float16)
        comm.all_gatherv(gv, values(r, sizes[r], torch.float16), sizes)
        assert torch.equal(gv, torch.cat([values(q, sizes[q], torch.float16) for q in range(n)]))

        for root in range(n):
            b = values(r, count, torch.int32)
            comm.broadcast(b, src=root)
            assert torch.equal(b, values(root, count, torch.int32)), f"broadcast root {root}"

            red = values(r, count)
            comm.reduce(red, dst=root, op="sum")
            if r == root:
                assert torch.equal(red, sum(values(q, count) for q in range(n))), "reduce"
            else:
                assert torch.equal(red, values(r, count)), "reduce must leave non-root input alone"

            outs = (
                [torch.empty(count, dtype=torch.float64) for _ in range(n)] if r == root else None
            )
            comm.gather(values(r, count, torch.float64), outs, dst=root)
            if r == root:
                for q in range(n):
                    assert torch.equal(outs[q], values(q, count, torch.float64)), "gather"
            piece = torch.empty(count, dtype=torch.int8)
            ins = [values(q + root, count, torch.int8) for q in range(n)] if r == root else None
            comm.scatter(ins, piece, src=root)
            assert torch.equal(piece, values(r + root, count, torch.int8)), "scatter"

        # all_to_all with uneven blocks: rank a sends (a + b + count) % 4 * count // 3 elements to b
        size = lambda a, b, count=count: (a + b + count) % 4 * count // 3  # noqa: E731
        sent = [values(10 * r + q, size(r, q)) for q in range(n)]
        got = [torch.empty(size(q, r)) for q in range(n)]
        comm.all_to_all(got, sent)
        for q in range(n):
            assert torch.equal(got[q], values(10 * q + r, size(q, r))), f"all_to_all from {q}"
        comm.barrier()
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_rooted_and_gather_collectives(world):
    # 300_000 floats crosses the chain threshold for broadcast/reduce and needs many ring slices
    run_ranks(world, rooted_and_gathers, [0, 1, 7, 4097, 300_000], timeout=120)


def numpy_arrays(comm):
    a = np.full(1000, comm.rank + 1, dtype=np.float64)
    comm.all_reduce(a, op="max")
    assert (a == comm.world_size).all()
    return True


def test_numpy_arrays():
    run_ranks(2, numpy_arrays)


def point_to_point(comm):
    r, n = comm.rank, comm.world_size
    # ring exchange where every rank posts its receive first: must not deadlock
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(100_000, dtype=torch.int64)
    recv_work = comm.irecv(got, left)
    send_work = comm.isend(torch.full((100_000,), r, dtype=torch.int64), right)
    recv_work.wait()
    send_work.wait()
    assert (got == left).all()
    # blocking, in order, with several messages between the same pair
    if r == 0:
        for i in range(5):
            comm.send(torch.full((i + 1,), float(i)), 1)
    elif r == 1:
        for i in range(5):
            t = torch.empty(i + 1)
            comm.recv(t, 0)
            assert (t == i).all()
    # receives from any source: every other rank sends rank 0 two messages, in order, with a
    # large one (striped over sockets, many shared-memory slots) in between
    if r == 0:
        sources = []
        for _ in range(2 * (n - 1)):
            t = torch.empty(300_000)
            src = comm.recv_any(t)
            sources.append(src)
            first = sources.count(src) == 1
            assert (t == (src if first else -src)).all(), (src, t[:3])
        assert sorted(sources) == sorted(list(range(1, n)) * 2)
        work = comm.recv_any(torch.empty(3), async_op=True)  # posted before the message exists
        comm.barrier()
        work.wait()
        assert work.source() == n - 1
    else:
        comm.send(torch.full((300_000,), float(r)), 0)
        comm.send(torch.full((300_000,), float(-r)), 0)
        comm.barrier()
        if r == n - 1:
            comm.send(torch.ones(3), 0)
    # point-to-point and collectives interleave
    t = torch.ones(10)
    comm.all_reduce(t)
    assert (t == n).all()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv(world):
    run_ranks(world, point_to_point)


def async_handles(comm):
    n = comm.world_size
    tensors = [torch.full((50_000,), float(i)) for i in range(8)]
    works = [comm.all_reduce(t, async_op=True) for t in tensors]
    futs = [w.get_future() for w in works]
    for i, (w, f) in enumerate(zip(works, futs)):
        assert w.wait(timeout=30) is True
        assert w.is_completed() and w.exception() is None
        assert f.wait() is tensors[i]
        assert (tensors[i] == i * n).all()
    # a future's callback chain
    t = torch.ones(4)
    chained = comm.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value() * 2)
    assert (chained.wait() == 2 * n).all()
    # async collectives of every kind, waited on in reverse order
    out = torch.empty(3 * n)
    works = [
        comm.all_gather(out, torch.full((3,), float(comm.rank)), async_op=True),
        comm.broadcast(torch.zeros(3), 0, async_op=True),
        comm.barrier(async_op=True),
    ]
    for w in reversed(works):
        w.wait()
    assert torch.equal(out, torch.arange(n).float().repeat_interleave(3))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_async_work_and_futures(world):
    run_ranks(world, async_handles)


def list_results_when_done(comm):
    # all_gather into a list copies out of a flat buffer after the core finishes; wait(),
    # is_completed() and the future must all come after that copy.
    stale = 0
    for i in range(200):
        expected = [i * 10 + r for r in range(comm.world_size)]
        outs = [
            [torch.zeros(1, dtype=torch.int64) for _ in range(comm.world_size)] for _ in range(2)
        ]
        by_wait = comm.all_gather(outs[0], torch.tensor([expected[comm.rank]]), async_op=True)
        by_wait.wait()
        by_future = comm.all_gather(outs[1], torch.tensor([expected[comm.rank]]), async_op=True)
        by_future.get_future().wait()
        assert by_wait.is_completed() and by_future.is_completed()
        stale += sum([int(t) for t in out] != expected for out in outs)
    return stale


def test_async_list_results_are_complete_when_waited():
    assert run_ranks(2, list_results_when_done) == [0, 0]
