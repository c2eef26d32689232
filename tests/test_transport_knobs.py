"""Transport settings: several sockets per peer (striping), bind address / interface choice."""

import os

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks


def striped_collectives(comm):
    n = comm.world_size
    t = torch.arange(3_000_001, dtype=torch.float32) + comm.rank  # > stripe threshold, odd size
    comm.all_reduce(t, op=dist.ReduceOp.SUM)
    expect = torch.arange(3_000_001, dtype=torch.float32) * n + sum(range(n))
    assert torch.equal(t, expect)
    small = torch.tensor([float(comm.rank)])
    comm.all_reduce(small, op=dist.ReduceOp.MAX)
    assert small.item() == n - 1
    b = torch.full((2_000_000,), float(comm.rank), dtype=torch.float64)
    comm.broadcast(b, src=n - 1)
    assert (b == n - 1).all()
    return True


@pytest.mark.parametrize("sockets", ["1", "3"])
def test_sockets_per_peer(sockets):
    env = {
        "RINGCOMM_SOCKETS_PER_PEER": sockets,
        "RINGCOMM_STRIPE_MIN_BYTES": "65536",
        "RINGCOMM_TRANSPORT": "tcp",
    }  # striping is TCP's; local ranks would share memory
    assert all(run_ranks(3, striped_collectives, env=env))


def bound_address(comm):
    t = torch.ones(10)
    comm.all_reduce(t)
    fields = dict(f.split("=", 1) for f in comm._core.address().split(";"))
    return fields["tcp"]


@pytest.mark.parametrize(
    "env,host",
    [
        ({"RINGCOMM_SOCKET_ADDR": "127.0.0.1"}, "127.0.0.1"),
        ({"RINGCOMM_SOCKET_IFNAME": "lo"}, "127.0.0.1"),
        ({"MASTER_ADDR": "127.0.0.1"}, "127.0.0.1"),
    ],
)
def test_bind_address_choice(env, host):
    for address in run_ranks(2, bound_address, env=env):
        assert address.rsplit(":", 1)[0] == host


def bad_interface(store, rank, world):
    import ringcomm

    try:
        ringcomm.Communicator(store, rank, world)
    except ValueError as e:
        return str(e)
    return "no error"


def test_unknown_interface_is_a_clear_error():
    messages = run_ranks(
        2, bad_interface, make_comm=False, env={"RINGCOMM_SOCKET_IFNAME": "nosuch0"}, timeout=30
    )
    assert all("nosuch0" in m for m in messages), messages


def cpu_while_waiting(comm, hold_s):
    """Rank 1 joins an all_reduce hold_s late; returns rank 0's CPU seconds spent in it."""
    import time

    buf = torch.ones(4)
    comm.barrier()
    if comm.rank == 1:
        time.sleep(hold_s)
    started = time.process_time()
    comm.all_reduce(buf)
    spent = time.process_time() - started
    assert buf.tolist() == [2.0] * 4
    return spent


@pytest.mark.serial  # an idle CPU: a yielding rank gets it back at once
@pytest.mark.parametrize("same_host", [True, False])
def test_a_rank_yields_its_cpu_only_to_ranks_of_its_host(same_host):
    # RINGCOMM_YIELD_US far above the wait: a rank on the waited-for rank's host yields (and,
    # the CPU being otherwise idle, burns most of the wait); one on another host blocks at once.
    hold = 0.4
    hosts = {0: {"RINGCOMM_HOST_ID": "a"}, 1: {"RINGCOMM_HOST_ID": "a" if same_host else "b"}}
    spent = run_ranks(
        2,
        cpu_while_waiting,
        hold,
        env={"RINGCOMM_YIELD_US": "5000000", "RINGCOMM_TRANSPORT": "tcp"},
        per_rank_env=hosts,
    )[0]
    if same_host:
        assert spent > 0.25 * hold, spent
    else:
        assert spent < 0.05 * hold, spent


def stacked_calls(comm, calls):
    """This rank's thread pinned to CPU 0, as its peer's: the median seconds of 8-byte
    all-reduces (they run on the calling thread)."""
    import os
    import statistics
    import time

    os.sched_setaffinity(0, {0})
    t = torch.ones(2)
    for _ in range(10):
        comm.all_reduce(t)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        comm.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.serial  # CPU 0 for the two ranks alone
def test_a_rank_does_not_spin_while_a_peer_waits_on_its_cpu():
    # Both ranks on one CPU, with 200 us of spinning before a rank yields: spinning while the peer
    # waits for the CPU, each handoff would take the whole spin (400 us a call or more).
    spin_s = 200e-6
    medians = run_ranks(
        2,
        stacked_calls,
        101,
        env={"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_SPIN_US": "200", "RINGCOMM_TUNING": "off"},
    )
    assert all(m < spin_s / 2 for m in medians), medians


def stack_until_moved(comm, seconds):
    """Puts this rank's thread on CPU 0, as its peer's, with both CPUs 0 and 1 allowed, before
    each 8-byte all-reduce, until a rank has moved off (or `seconds`): this rank's moves, and
    the CPUs its thread may run on afterwards."""
    import os
    import time

    t = torch.zeros(2)
    end = time.monotonic() + seconds
    while True:
        os.sched_setaffinity(0, {0})  # migrates there now
        os.sched_setaffinity(0, {0, 1})  # and may leave
        t[0], t[1] = comm.stats()["cpu_moves"], float(time.monotonic() > end)
        comm.all_reduce(t, op="max")  # both ranks stop at the same call
        if t.sum() > 0:
            return comm.stats()["cpu_moves"], sorted(os.sched_getaffinity(0))


@pytest.mark.serial  # CPUs 0 and 1 for the two ranks alone
@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
@pytest.mark.parametrize("unstack", ["1", "0"])
def test_the_higher_rank_moves_off_a_cpu_its_peer_waits_on(unstack):
    # Two ranks, two CPUs, both put on CPU 0: rank 1 moves its thread to CPU 1 and gives it its
    # CPU set back; rank 0 stays. RINGCOMM_SHM_UNSTACK=0: neither moves.
    got = run_ranks(
        2,
        stack_until_moved,
        3.0 if unstack == "1" else 0.3,
        env={
            "RINGCOMM_TRANSPORT": "shm",
            "RINGCOMM_TUNING": "off",
            "RINGCOMM_SHM_UNSTACK": unstack,
        },
    )
    assert [cpus for _, cpus in got] == [[0, 1], [0, 1]]
    moves = [m for m, _ in got]
    assert moves[0] == 0 and (moves[1] >= 1 if unstack == "1" else moves[1] == 0), moves
