"""The torch.distributed backend "ringcomm": every op against gloo's result, subgroups, mixed
configs, torchrun, async futures, errors."""

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ringcomm
from ringcomm import fusion
from ringcomm._buffers import TORCH_DTYPES, Buffer
import ranks
from ranks import run_ranks, run_torchrun, seconds_until_handler_runs


def init_ringcomm_and_gloo(store, rank, world):
    """ringcomm as the default group, and a gloo group over the same ranks to compare with."""
    dist.init_process_group(
        "ringcomm", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    return dist.new_group(backend="gloo")


def values(rank, shape, dtype=torch.float32):
    n = torch.Size(shape).numel()
    # integer values: every summation order gives the same bits, so results compare exactly
    return ((torch.arange(n) % 13 + 3 * rank - 5).to(dtype)).reshape(shape)


def assert_same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (
            f"{where}: {a} != {b}"
        )
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


def each_op(store, rank, world):
    """Runs each op on ringcomm and on gloo and compares; returns the names of the ops run."""
    gloo = init_ringcomm_and_gloo(store, rank, world)
    assert dist.get_backend() == "ringcomm" and dist.get_backend(gloo) == "gloo"
    n, names = world, []

    def both(name, run):
        assert_same(run(None), run(gloo), f"rank {rank}, {name}")
        names.append(name)

    def all_reduce(op, dtype):
        def run(group):
            t = values(rank, (7, 3), dtype)
            dist.all_reduce(t, op=op, group=group)
            return t

        return run

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        both(f"all_reduce {op}", all_reduce(op, torch.float32))
    both("all_reduce int64", all_reduce(dist.ReduceOp.SUM, torch.int64))
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        both(f"all_reduce {op}", all_reduce(op, torch.int32))

    def non_contiguous(group):
        t = values(rank, (6, 4)).t()  # staged through a contiguous copy, copied back
        dist.all_reduce(t, group=group)
        return t

    both("all_reduce non-contiguous", non_contiguous)

    def all_reduce_large(group):
        t = values(rank, (300_000,))  # past the small-message threshold: the ring algorithm
        dist.all_reduce(t, group=group)
        return t

    both("all_reduce large", all_reduce_large)

    def coalesced(group):
        ts = [values(rank, (5,)), values(rank + 1, (2, 3)), values(rank + 2, (1,))]
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, group=group)
        cm.wait()
        return ts

    both("all_reduce coalesced", coalesced)

    def gathers_coalesced(group):
        ins = [values(rank, (3,)), values(rank, (2, 2), torch.int64)]
        gathered = [torch.empty(3 * n), torch.empty(2 * n, 2, dtype=torch.int64)]
        reduced = [torch.empty(2), torch.empty(1, dtype=torch.float64)]
        rs_ins = [values(rank, (2 * n,)), values(rank, (n,), torch.float64)]
        lists = [[torch.empty(4), torch.empty(1)] for _ in range(n)]  # lists[q][i]: rank q's ins[i]
        list_ins = [values(rank, (4,)), values(rank + 1, (1,))]
        if group is None:  # ringcomm's coalesced forms
            with dist._coalescing_manager():
                for out, inp in zip(gathered, ins):
                    dist.all_gather_single(out, inp)
            with dist._coalescing_manager():
                for out, inp in zip(reduced, rs_ins):
                    dist.reduce_scatter_single(out, inp)
        else:  # gloo's one by one
            for out, inp in zip(gathered, ins):
                dist.all_gather_single(out, inp, group=group)
            for out, inp in zip(reduced, rs_ins):
                dist.reduce_scatter_single(out, inp, group=group)
        dist.all_gather_coalesced(lists, list_ins, group=group)
        return gathered, reduced, lists

    both("all_gather and reduce_scatter coalesced", gathers_coalesced)

    def broadcast(group):
        out = []
        for root in range(n):
            t = values(rank, (4, 5), torch.float64)
            dist.broadcast(t, src=root, group=group)
            out.append(t)
        return out

    both("broadcast", broadcast)

    def reduce(group):
        out = []
        for root in range(n):
            t = values(rank, (9,))
            dist.reduce(t, dst=root, group=group)
            out.append(t if rank == root else None)  # gloo uses non-roots' tensors as scratch
        return out

    both("reduce", reduce)

    def all_gather(group):
        pieces = [torch.empty(2, 3, dtype=torch.bfloat16) for _ in range(n)]
        dist.all_gather(pieces, values(rank, (2, 3), torch.bfloat16), group=group)
        return pieces

    both("all_gather list", all_gather)

    def all_gather_into_tensor(group):
        out = torch.empty(n * 2, 5, dtype=torch.int32)
        dist.all_gather_single(out, values(rank, (2, 5), torch.int32), group=group)
        return out

    both("all_gather_into_tensor", all_gather_into_tensor)

    def reduce_scatter(group):
        out = torch.empty(3, 2)
        dist.reduce_scatter(out, [values(rank + q, (3, 2)) for q in range(n)], group=group)
        return out

    both("reduce_scatter list", reduce_scatter)

    def reduce_scatter_tensor(group):
        out = torch.empty(4)
        dist.reduce_scatter_single(out, values(rank, (4 * n,)), op=dist.ReduceOp.MAX, group=group)
        return out

    both("reduce_scatter_tensor", reduce_scatter_tensor)

    def gather(group):
        out = []
        for root in range(n):
            pieces = [torch.empty(6) for _ in range(n)] if rank == root else None
            dist.gather(values(rank, (6,)), pieces, dst=root, group=group)
            out.append(pieces)
        return out

    both("gather", gather)

    def scatter(group):
        out = []
        for root in range(n):
            t = torch.empty(2, 2, dtype=torch.int64)
            pieces = (
                [values(q + 10 * rank, (2, 2), torch.int64) for q in range(n)]
                if rank == root
                else None
            )
            dist.scatter(t, pieces, src=root, group=group)
            out.append(t)
        return out

    both("scatter", scatter)

    def all_to_all(group):
        outs = [torch.empty(3) for q in range(n)]  # gloo needs equal sizes here
        dist.all_to_all(outs, [values(rank * n + q, (3,)) for q in range(n)], group=group)
        return outs

    both("all_to_all", all_to_all)

    def all_to_all_single(group):
        even_out = torch.empty(2 * n, 3)
        dist.all_to_all_single(even_out, values(rank, (2 * n, 3)), group=group)
        in_splits = [(rank + q) % 3 for q in range(n)]  # rows rank sends to q; some empty
        out_splits = [(q + rank) % 3 for q in range(n)]  # rows q sends to rank
        uneven_out = torch.empty(sum(out_splits), 3)
        dist.all_to_all_single(
            uneven_out, values(rank, (sum(in_splits), 3)), out_splits, in_splits, group=group
        )
        return even_out, uneven_out

    both("all_to_all_single", all_to_all_single)

    def point_to_point(group):
        right, left = (rank + 1) % n, (rank - 1) % n
        got = torch.empty(1000)
        ops = [
            dist.P2POp(dist.irecv, got, left, group),
            dist.P2POp(dist.isend, values(rank, (1000,)), right, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        blocking = torch.zeros(3, dtype=torch.float64)
        if rank == 0:
            dist.send(values(7, (3,), torch.float64), 1, group=group)
        elif rank == 1:
            dist.recv(blocking, 0, group=group)
        return got, blocking

    both("send/recv", point_to_point)

    def tagged(group):
        # tags travel with each message; every pair keeps them in the same order
        got = [torch.empty(2) for _ in range(3)]
        if rank == 0:
            for tag in (7, 8, 9):
                dist.send(values(tag, (2,)), 1, group=group, tag=tag)
        elif rank == 1:
            for tag, t in zip((7, 8, 9), got):
                dist.recv(t, 0, group=group, tag=tag)
        return got if rank == 1 else None

    both("send/recv with tags", tagged)

    def objects(group):
        gathered = [None] * n
        dist.all_gather_object(gathered, {"rank": rank, "name": "x" * rank}, group=group)
        sent = [{"from": rank, "payload": list(range(rank + 3))}, "two"]
        dist.broadcast_object_list(sent, src=n - 1, group=group)
        received = [None]
        dist.scatter_object_list(
            received, [f"to {q}" for q in range(n)] if rank == 0 else None, src=0, group=group
        )
        return gathered, sent, received

    both("objects", objects)

    dist.barrier()
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return names


@pytest.mark.parametrize("world", [2, 3])
def test_each_op_matches_gloo(world):
    names = run_ranks(world, each_op, make_comm=False, timeout=90)
    assert len(names[0]) == 25 and names[1] == names[0], names


def average(store, rank, world):
    # AVG and PREMUL_SUM have no gloo counterpart: compare with SUM.
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    checks = []
    for dtype in (torch.float32, torch.int64, torch.int8):
        t = values(rank, (100,), dtype)
        total = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        dist.all_reduce(total)
        # NCCL's semantics on integers: the sum divided with truncation toward zero
        expect = (
            total / world
            if dtype.is_floating_point
            else torch.div(total, world, rounding_mode="trunc")
        )
        checks.append(torch.equal(t, expect))
    t = values(rank, (50,))
    total = t.clone()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    dist.all_reduce(total)
    checks.append(torch.equal(t, total * 0.5))
    out, total_out = torch.empty(4), torch.empty(4)
    t = values(rank, (4 * world,))
    before = t.clone()
    dist.reduce_scatter_tensor(out, t, op=dist._make_nccl_premul_sum(2.0))
    dist.reduce_scatter_tensor(total_out, t)
    checks.append(torch.equal(out, total_out * 2) and torch.equal(t, before))  # input untouched
    dist.destroy_process_group()
    return checks


def test_average_and_premul_sum():
    for checks in run_ranks(3, average, make_comm=False):
        assert checks == [True] * 5, checks


def subgroups(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    # every rank creates every group, members or not, in the same order (torch's rule)
    groups = {
        tuple(r): dist.new_group(r, backend="ringcomm") for r in ([0, 1], [1, 2], [0, 2], [0, 1, 2])
    }
    sums = {}
    for members, group in groups.items():
        if rank in members:
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=group)
            sums[members] = float(t)
            assert dist.get_backend(group) == "ringcomm"
            assert group.size() == len(members) and group.rank() == members.index(rank)
    # a broadcast inside a subgroup names the source by its global rank
    if rank in (1, 2):
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=2, group=groups[(1, 2)])
        sums["broadcast"] = float(b)
    dist.barrier()
    dist.destroy_process_group()
    return sums


def test_subgroups():
    results = run_ranks(3, subgroups, make_comm=False)
    assert results[0] == {(0, 1): 3.0, (0, 2): 4.0, (0, 1, 2): 6.0}
    assert results[1] == {(0, 1): 3.0, (1, 2): 5.0, (0, 1, 2): 6.0, "broadcast": 2.0}
    assert results[2] == {(1, 2): 5.0, (0, 2): 4.0, (0, 1, 2): 6.0, "broadcast": 2.0}


def mixed_config(store, rank, world):
    if dist.is_nccl_available():
        dist.init_process_group("cpu:ringcomm,cuda:nccl", store=store, rank=rank, world_size=world)
        assert dist.get_backend_config() == "cpu:ringcomm,cuda:nccl"
        dist.destroy_process_group()
    else:
        # torch creates every backend a config names, at once: without NCCL, this config fails
        # exactly as it does with gloo for CPU tensors. Each rank alone: a group that both ranks
        # make half of and drop races the peer still connecting to it (gloo's hung once, rank 0
        # connecting to a rank 1 that had raised already).
        for cpu_backend in ("gloo", "ringcomm"):
            with pytest.raises(RuntimeError, match="doesn't have NCCL built in"):
                dist.init_process_group(
                    f"cpu:{cpu_backend},cuda:nccl", rank=0, world_size=1, store=dist.HashStore()
                )
    dist.init_process_group(
        "cpu:ringcomm", store=dist.PrefixStore("cpu", store), rank=rank, world_size=world
    )
    assert dist.get_backend_config() == "cpu:ringcomm"
    t = torch.ones(10)
    before = ringcomm.shm_bytes_sent()
    dist.all_reduce(t)
    # the backend's communicator is counted too (local ranks talk over shared memory)
    assert ringcomm.shm_bytes_sent() > before
    objs = [None] * world
    dist.all_gather_object(objs, rank)
    dist.barrier()
    dist.destroy_process_group()

    return float(t[0]), objs


def test_mixed_backend_config():
    for result in run_ranks(2, mixed_config, make_comm=False):
        assert result == (2.0, [0, 1])


def async_future(store, rank, world):
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    t = torch.full((1000,), float(rank))
    if rank == 1:
        time.sleep(0.5)  # rank 0's operation cannot finish before this rank joins
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    pending = not fut.done() and not work.is_completed()
    if rank == 0:
        with pytest.raises(RuntimeError, match="Timed out waiting 100ms for ALLREDUCE"):
            work.wait(timedelta(seconds=0.1))
    chained = fut.then(lambda f: f.value()[0] * 2)
    value = fut.wait()
    ok = (
        isinstance(value, list)
        and value[0] is t
        and work.is_completed()
        and work.wait()
        and torch.equal(chained.wait(), torch.full((1000,), 2.0))
    )
    # every kind of op returns a Work with a future
    out = torch.empty(world)
    works = [
        dist.all_gather_single(out, torch.tensor([float(rank)]), async_op=True),
        dist.broadcast(torch.zeros(2), 0, async_op=True),
        dist.barrier(async_op=True),
    ]
    futures_ok = all(isinstance(w.get_future(), torch._C.Future) for w in works)
    for w in works:
        w.get_future().wait()
    dist.destroy_process_group()
    return pending, ok, futures_ok, out.tolist()


def test_work_future_completes_asynchronously():
    rank0, rank1 = run_ranks(2, async_future, make_comm=False)
    assert rank0 == (True, True, True, [0.0, 1.0])
    assert rank1[1:] == (True, True, [0.0, 1.0])


def coalescing_by_device():
    try:
        with dist._coalescing_manager(device=torch.device("cpu")):
            dist.all_reduce(torch.ones(2))
    finally:
        # torch registers the coalescing state before asking the group, and leaves it behind when
        # the group refuses: later ops would only be recorded, never run
        dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)


def errors(store, rank, world):
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    cases = [
        (
            lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
            TypeError,
            "band needs an integer",
        ),
        (
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG),
            TypeError,
            "avg is undefined on bool",
        ),
        (
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)),
            TypeError,
            "unsupported dtype",
        ),
        (lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3)), ValueError, "split evenly"),
        (
            lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3), [1, 1], [2, 2]),
            ValueError,
            "output split sizes add up to 2 rows, the tensor has 3",
        ),
        (
            lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(2)),
            ValueError,
            "world size x input",
        ),
        (
            lambda: dist.gather(torch.ones(2), [torch.empty(3)] * world if rank == 0 else None),
            ValueError,
            "elements where 2 are expected" if rank == 0 else None,
        ),
        (coalescing_by_device, RuntimeError, "startCoalescing"),
        (lambda: dist.monitored_barrier(), ValueError, "GLOO"),
    ]
    messages = []
    for call, error, text in cases:
        if text is None:
            continue  # the check happens on another rank
        with pytest.raises(error, match=text) as info:
            call()
        messages.append(str(info.value))
    t = torch.ones(3)
    dist.all_reduce(t)  # nothing above reached the wire
    dist.destroy_process_group()
    return float(t[0]), messages


def test_unsupported_and_bad_input_raise_clear_errors():
    for value, messages in run_ranks(2, errors, make_comm=False):
        assert value == 2.0, messages


def peer_dies(store, rank, world):
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    if rank == 2:
        os._exit(3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2") as info:
        for _ in range(1000):
            dist.all_reduce(t)
    elapsed = time.monotonic() - start
    with pytest.raises(RuntimeError, match="broken"):  # and the group stays broken
        dist.all_reduce(t)
    return str(info.value), elapsed


def test_dead_peer_raises_from_wait():
    results = run_ranks(3, peer_dies, make_comm=False, allow_errors=True, timeout=60)
    for result in results[:2]:
        assert result[0] != "error", result
        message, elapsed = result
        assert elapsed < 10, message


def failed_work(store, rank, world):
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    work = dist.all_reduce(torch.ones(10 + rank), async_op=True)  # the sizes disagree
    with pytest.raises(RuntimeError, match="mismatched operations"):
        work.wait()
    with pytest.raises(RuntimeError, match="mismatched operations"):
        work.get_future().wait()
    return work.is_completed(), work.is_success(), "mismatched" in str(work.exception())


def test_failed_work_reports_its_error():
    assert run_ranks(2, failed_work, make_comm=False) == [(True, False, True)] * 2


def monitored(store, rank, world):
    # torch's dist.monitored_barrier is gloo-only by name; the group's own method reaches ringcomm
    dist.init_process_group(
        "ringcomm", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=3)
    )
    group = dist.group.WORLD
    group.monitored_barrier(timedelta(seconds=5), wait_all_ranks=True)  # everyone arrives
    if rank == 2:
        time.sleep(1.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        group.monitored_barrier(timedelta(seconds=0.5), wait_all_ranks=True)
    return str(info.value), time.monotonic() - start


def test_monitored_barrier_names_the_rank_that_did_not_arrive():
    results = run_ranks(3, monitored, make_comm=False, timeout=60)
    message, elapsed = results[0]
    assert "rank 2 failed to pass monitoredBarrier in 500 ms" in message, message
    assert elapsed < 1.5, elapsed
    assert "was not released by rank 0" in results[1][0], results[1]


def group_abort(store, rank, world):
    dist.init_process_group(
        "ringcomm", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    if rank == 1:
        store.wait(["test/aborted"], timedelta(seconds=30))  # joins after rank 0 has given up
        with pytest.raises(RuntimeError, match="ProcessGroup.abort") as info:
            dist.all_reduce(torch.ones(1 << 20))
        store.set("test/heard", "1")
        return str(info.value)
    work = dist.all_reduce(torch.ones(1 << 20), async_op=True)
    time.sleep(0.3)
    start = time.monotonic()
    dist.group.WORLD.abort()  # fails the pending op at once, not after the 30 s timeout
    with pytest.raises(RuntimeError, match="aborted: ProcessGroup.abort"):
        work.wait()
    elapsed = time.monotonic() - start
    store.set("test/aborted", "1")
    store.wait(["test/heard"], timedelta(seconds=30))  # alive until rank 1 has read the reason
    return elapsed


def test_process_group_abort_fails_pending_work_at_once():
    elapsed, peer = run_ranks(2, group_abort, make_comm=False, timeout=60)
    assert elapsed < 2, elapsed
    assert "ProcessGroup.abort() called" in peer, peer


def signal_during_wait(store, rank, world):
    dist.init_process_group(
        "ringcomm", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    if rank == 1:
        time.sleep(2.0)
        dist.all_reduce(torch.ones(4))  # joins late: rank 0's handler has run by then
        return None
    work = dist.all_reduce(torch.ones(4), async_op=True)
    elapsed = seconds_until_handler_runs(work)
    work.wait()  # the operation itself goes on, and completes once rank 1 joins
    return elapsed


def test_work_wait_runs_signal_handlers():
    elapsed, _ = run_ranks(2, signal_during_wait, make_comm=False, timeout=60)
    assert elapsed < 1.0, elapsed


def tags_disagree(store, rank, world):
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    with pytest.raises(RuntimeError, match="mismatched operations") as info:
        if rank == 0:
            dist.send(torch.ones(4), 1, tag=1)
            dist.barrier()  # the send may complete before rank 1 looks at it
        else:
            dist.recv(torch.empty(4), 0, tag=2)
    return str(info.value)


def test_send_recv_tags_that_disagree_fail_on_both_ranks():
    for message in run_ranks(2, tags_disagree, make_comm=False):
        assert "tag=1" in message and "tag=2" in message, message


def registration_is_idempotent():
    ringcomm.register_backend()
    ringcomm.register_backend()
    return dist.Backend.backend_list.count("ringcomm"), dist.Backend.RINGCOMM


def test_registration_is_idempotent():
    assert registration_is_idempotent() == (1, "ringcomm")


TORCHRUN_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, ringcomm
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("ringcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [None] * world
    dist.all_gather_object(names, f"rank{rank}")
    torch.manual_seed(rank)  # different initial weights: DDP construction broadcasts rank 0's
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    grads = [torch.empty(2, 4) for _ in range(world)]
    dist.all_gather(grads, model.module.weight.grad)
    weights = [torch.empty(2, 4) for _ in range(world)]
    dist.all_gather(weights, model.module.weight.detach())
    same = all(torch.equal(g, grads[0]) for g in grads) and all(torch.equal(w, weights[0]) for w in weights)
    print(f"rank {rank} of {world} {dist.get_backend()}: {names} same={same}", flush=True)
    dist.destroy_process_group()
""")


def test_torchrun_init_and_ddp(tmp_path):
    stdout = run_torchrun(tmp_path, TORCHRUN_SCRIPT, 2)
    for r in range(2):
        assert f"rank {r} of 2 ringcomm: ['rank0', 'rank1'] same=True" in stdout, stdout


ELASTIC_SCRIPT = textwrap.dedent("""
    import os
    import torch, torch.distributed as dist, ringcomm
    from torch.nn.parallel import DistributedDataParallel as DDP
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("ringcomm")
    rank = dist.get_rank()
    comm = ringcomm.init()  # a plain communicator too, over the same store
    t = torch.ones(4)
    dist.all_reduce(t)
    comm.all_reduce(t)
    if attempt == 0 and rank == 1:
        os._exit(3)  # a lost rank: torchrun restarts the whole group
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(8, 4)).sum().backward()
    print(f"rank {rank} attempt {attempt} sum {float(t[0])}", flush=True)
    dist.destroy_process_group()
""")


def test_torchrun_restarts_the_group_after_a_rank_dies(tmp_path):
    # the survivor of attempt 0 fails fast (its peer is gone), and attempt 1 rendezvouses anew
    stdout = run_torchrun(tmp_path, ELASTIC_SCRIPT, 2, timeout=180, extra=["--max-restarts", "1"])
    for r in range(2):
        assert f"rank {r} attempt 1 sum 4.0" in stdout, stdout


# ---- the module's other use: reading tensor lists for the coalesced collectives ----------------------------------------------------------------


class Marked(torch.Tensor):
    pass


def test_buffer_list_reads_in_cpp_what_python_reads(monkeypatch):
    module = ringcomm.backend.load()
    assert ringcomm.backend.built() is module
    items = [torch.arange(5).to(dtype) for dtype in TORCH_DTYPES] + [
        torch.empty(0),
        torch.empty(0, 3),
        torch.nn.Parameter(torch.ones(3)),
        torch.ones(2, 3),
        torch.arange(10.0)[4:],
        torch.ones(1, requires_grad=True),
    ]
    read = fusion.BufferList(items)
    monkeypatch.setattr(fusion, "torch_module", lambda: None)
    expect = fusion.BufferList(items)
    lists = (expect.ptrs.tolist(), expect.counts.tolist(), expect.dtypes.tolist())
    assert (read.ptrs.tolist(), read.counts.tolist(), read.dtypes.tolist()) == lists
    assert all(len(v) == len(items) for v in lists)
    assert (
        tuple(memoryview(b).cast("Q").tolist() for b in module.tensor_lists(tuple(items))) == lists
    )
    assert module.tensor_lists([]) == (b"", b"", b"")
    assert module.tensor_lists(items, "cpu") is not None
    # tensors on another device than the one asked for (ringcomm.cuda.pack asks for a GPU's)
    assert module.tensor_lists(items, "cuda:0") is None
    assert module.tensor_lists([torch.ones(2, device="meta")], "cpu") is None
    with pytest.raises(RuntimeError, match="device"):
        module.tensor_lists(items, "a device")
    # anything else is left to the Python path, which names the item or reads it
    for other in (
        [torch.ones(4, 4).t()],
        [torch.ones(2, dtype=torch.complex64)],
        [torch.ones(2).as_subclass(Marked)],
        [torch.ones(3).to_sparse()],
        [torch.ones(2, device="meta")],
        [np.ones(3)],
        [torch.ones(2), 1.0],
        "tensors",
        iter([torch.ones(2)]),
    ):
        assert module.tensor_lists(other) is None, other
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        fusion.BufferList([torch.ones(2), torch.ones(4, 4).t()])
    # memory that does not hold the values, or no memory: refused on both paths, named
    freed = torch.ones(6)[2:]
    freed.untyped_storage().resize_(0)
    for bad, why in (
        (torch._neg_view(torch.ones(3)), "negated view"),
        (torch._efficientzerotensor(4), "no memory"),
        (freed, "no memory"),
    ):
        assert module.tensor_lists([torch.ones(2), bad]) is None
        for reader in (lambda: module, lambda: None):
            monkeypatch.setattr(fusion, "torch_module", reader)
            with pytest.raises(ValueError, match=rf"tensors\[1\] .*{why}"):
                fusion.BufferList([torch.ones(2), bad])
        with pytest.raises(ValueError, match=why):  # one tensor: all_reduce's own check
            Buffer(bad)


def both_paths(comm):
    """A blocking all_reduce read in C++ and the same through Buffer: equal results; what the C++
    reader leaves to Buffer named as before; a failure raised as the RingcommError of its kind."""
    assert comm._tensor_path is not None  # the module is built: the C++ reader is in use
    same = []
    for dtype, op in (
        (torch.float32, "sum"),
        (torch.float32, "avg"),
        (torch.bfloat16, "max"),
        (torch.int64, "bxor"),
        (torch.int32, "min"),
        (torch.bool, "bor"),
    ):
        given = (torch.arange(7) * (comm.rank + 2)).to(dtype)
        read_in_cpp, by_buffer = given.clone(), given.clone()
        comm.all_reduce(read_in_cpp, op)
        path, comm._tensor_path = comm._tensor_path, None
        comm.all_reduce(by_buffer, op)
        comm._tensor_path = path
        same.append(torch.equal(read_in_cpp, by_buffer))
    total = torch.arange(7.0)
    comm.all_reduce(total)
    same.append(torch.equal(total, torch.arange(7.0) * comm.world_size))
    errors = []
    freed = torch.ones(6)[2:]
    freed.untyped_storage().resize_(0)  # its address still looks valid
    for bad, op in (
        (torch.ones(4, 4).t(), "sum"),
        (torch.ones(3, dtype=torch.bool), "avg"),
        (torch.ones(3), "band"),
        (freed, "sum"),
    ):
        try:
            comm.all_reduce(bad, op)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    try:  # a mismatch (4 elements against 8): the communicator is broken after it
        comm.all_reduce(torch.ones(4 * (comm.rank + 1)))
    except ringcomm.RingcommError as e:
        errors.append(type(e).__name__)
    return same, errors


def test_a_blocking_all_reduce_reads_its_tensor_in_cpp():
    ringcomm.backend.load()  # built, in the cache the ranks look in
    for same, errors in run_ranks(2, both_paths):
        assert all(same), same
        assert (
            len(errors) == 5
            and "contiguous" in errors[0]
            and "bool" in errors[1]
            and "integer" in errors[2]
            and "no memory" in errors[3]
            and errors[4] == "MismatchError"
        ), errors


def _built_in(cache: str) -> str:
    os.environ["RINGCOMM_TORCH_BUILD_DIR"] = cache
    m = ringcomm.backend.built()
    return "loaded" if m is not None and m.tensor_lists([]) == (b"", b"", b"") else "none"


def test_built_loads_only_a_finished_build_and_never_waits(tmp_path):
    import fcntl
    import shutil

    ringcomm.backend.load()  # built, in this process's cache
    real = ringcomm._extension.build_dir(ringcomm._extension.sources())

    def built_in_a_fresh_process(cache):
        # a fork of the ranks' fork server, which has imported ringcomm and nothing more
        with ranks.CTX.Pool(1) as pool:
            return pool.apply(_built_in, (str(cache),))

    assert built_in_a_fresh_process(real.parent) == "loaded"
    with open(real / "ringcomm.lock") as lock:  # a rebuild under way: not loaded, not waited on
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert built_in_a_fresh_process(real.parent) == "none"
    # the library without the stamp that load() leaves once it has loaded: as if a build died
    copy = tmp_path / real.name
    copy.mkdir()
    shutil.copy(real / "ringcomm_C_torch.so", copy)
    (copy / "ringcomm.lock").touch()
    assert built_in_a_fresh_process(tmp_path) == "none"
    (copy / "ringcomm.built").touch()
    assert built_in_a_fresh_process(tmp_path) == "loaded"


def test_built_never_starts_a_build(tmp_path):
    # a cache without this torch's build: the coalesced path reads its lists in Python
    code = (
        "import torch, ringcomm\n"
        "from ringcomm import backend, fusion\n"
        "assert backend.built() is None and backend.built() is None\n"
        "assert fusion.BufferList([torch.ones(3)]).counts.tolist() == [3]\n"
    )
    env = dict(os.environ, RINGCOMM_TORCH_BUILD_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert list(tmp_path.iterdir()) == []
