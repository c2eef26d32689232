"""Bad input, mismatched collectives, dead peers, strangers and timeouts: clear errors, no hangs."""

import os
import threading
import time
from array import array
from datetime import timedelta

import numpy as np
import pytest
import torch

import ringcomm
from ringcomm import _C
from ringcomm._buffers import TORCH_DTYPES
from ranks import expect_error, run_ranks, seconds_until_handler_runs

pytestmark = pytest.mark.every_transport  # once per transport (conftest.py)


# ---- mismatched collectives ---------------------------------------------------------------


def mismatched(comm, kind, count):
    r = comm.rank
    odd = r == 1
    if kind == "count":
        call = lambda: comm.all_reduce(torch.ones(count + (3 if odd else 0)))
    elif kind == "dtype":
        call = lambda: comm.all_reduce(
            torch.ones(count, dtype=torch.float64 if odd else torch.float32)
        )
    elif kind == "op":
        call = lambda: comm.all_reduce(torch.ones(count), op="max" if odd else "sum")
    elif kind == "collective":
        call = (
            (lambda: comm.broadcast(torch.ones(count), 0))
            if odd
            else (lambda: comm.all_reduce(torch.ones(count)))
        )
    elif kind == "root":
        # Both think they are the root, so both only send: the broadcast itself can complete,
        # and the mismatch surfaces on the next call, when a stray message is read. With 4
        # ranks, one that no stray message reaches (rank 1's tree does not send to rank 0) can
        # finish that call too, before the abort of the rank that read one arrives: it raises
        # on the call after, with that rank's reason.
        def call():
            comm.broadcast(torch.ones(count), 1 if odd else 0)
            comm.all_reduce(torch.ones(5))
            comm.all_reduce(torch.ones(5))

    def good_then_bad():
        # A matching call first, so sequence numbers agree. A rank still in it may already hear
        # another rank's abort for the mismatch that follows, and raise there: that is intended.
        comm.all_reduce(torch.ones(5))
        call()

    # Every rank raises MismatchError: the ranks that did not see the mismatch themselves hear it
    # in the abort of one that did, with its kind; so does every later call.
    message, elapsed = expect_error(good_then_bad, ringcomm.MismatchError)
    broken, _ = expect_error(lambda: comm.all_reduce(torch.ones(5)), ringcomm.MismatchError)
    return message, elapsed, broken


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "kind,count",
    [
        ("count", 10),
        ("count", 1 << 20),
        ("dtype", 100),
        ("op", 1 << 20),
        ("collective", 1000),
        ("root", 100),
    ],
)
def test_mismatch_raises_on_every_rank(world, kind, count):
    results = run_ranks(world, mismatched, kind, count, timeout=60, comm_timeout=30)
    for rank, (message, elapsed, broken) in enumerate(results):
        assert "mismatched operations" in message, f"rank {rank}: {message}"
        # both sides of the mismatch are named
        assert "rank 1 issued" in message or "but rank 1 issued" in message, message
        assert message.count("seq=1") >= (1 if kind == "root" else 2), message
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f}s to notice"
        assert "broken" in broken


def both_counts_named(comm):
    message, _ = expect_error(lambda: comm.all_reduce(torch.ones(7 if comm.rank == 2 else 9)))
    return message


def test_mismatch_message_names_both_counts():
    for message in run_ranks(3, both_counts_named):
        assert "count=7" in message and "count=9" in message, message


def gather_vs_send(comm):
    # the gather's messages have their own signature: a plain send into it is a mismatch
    if comm.rank == 0:
        call = lambda: comm.gather(torch.ones(6), [torch.empty(6), torch.empty(6)], dst=0)
    else:

        def call():
            comm.send(torch.ones(6), 0)
            comm.all_reduce(torch.ones(2))  # the send may complete before rank 0 reads it

    return expect_error(call)[0]


def any_source_wrong_size(comm):
    if comm.rank == 0:
        call = lambda: comm.recv_any(torch.empty(4))
    else:

        def call():
            comm.send(torch.ones(5), 0)
            comm.all_reduce(torch.ones(2))  # the send may complete before rank 0 reads it

    return expect_error(call)[0]


def test_a_receive_from_any_source_checks_what_it_takes():
    for message in run_ranks(2, any_source_wrong_size):
        assert "mismatched" in message and "count=5" in message and "count=4" in message, message


def test_gather_against_a_send_is_a_mismatch():
    for message in run_ranks(2, gather_vs_send):
        assert "mismatched" in message and "gather" in message, message


def empty_vs_nonempty(comm):
    return expect_error(lambda: comm.all_reduce(torch.ones(0 if comm.rank == 0 else 5)))[0]


def test_empty_against_nonempty_is_a_mismatch():
    for message in run_ranks(2, empty_vs_nonempty):
        assert "mismatched" in message


def kinds_of_async_errors(comm):
    """The error's class reaches every way an asynchronous operation reports it: wait(),
    exception(), and the future (as DDP hooks use it). A wait that runs out of time is a
    timeout, and leaves the operation running."""
    if comm.rank == 1:
        time.sleep(0.5)
    work = comm.all_reduce(torch.ones(10), async_op=True)
    waited = None
    if comm.rank == 0:
        waited = expect_error(lambda: work.wait(timeout=0.05), ringcomm.CollectiveTimeoutError)[0]
    work.wait()
    bad = comm.all_reduce(torch.ones(8 if comm.rank == 0 else 9), async_op=True)
    future = bad.get_future()
    expect_error(bad.wait, ringcomm.MismatchError)
    from_future = None
    try:
        future.wait()
    except Exception as e:  # noqa: BLE001  the future's own error, whatever its class
        from_future = e
    return waited, type(bad.exception()).__name__, type(from_future).__name__, str(from_future)


def test_asynchronous_errors_keep_their_kind():
    results = run_ranks(2, kinds_of_async_errors)
    for rank, (waited, exception, from_future, text) in enumerate(results):
        assert rank == 1 or "Timed out after 0.05s" in waited, waited
        assert exception == "MismatchError", exception
        assert from_future == "MismatchError" and "count=8" in text, (from_future, text)


# ---- dead peers ---------------------------------------------------------------------------


def peer_dies(comm):
    big = torch.ones(4 << 20)
    if comm.rank == 2:
        threading.Timer(0.5, lambda: os._exit(17)).start()
        while True:
            comm.all_reduce(big)
    died_at = time.monotonic() + 0.5
    # Its ring neighbours see the closed connection; the others hear of it in their aborts.
    message, _ = expect_error(
        lambda: [comm.all_reduce(big) for _ in range(10_000)], ringcomm.PeerLostError
    )
    return message, time.monotonic() - died_at


def test_dead_peer_raises_everywhere_within_seconds():
    results = run_ranks(3, peer_dies, allow_errors=True, timeout=60, comm_timeout=60)
    for rank in (0, 1):
        message, after = results[rank]
        assert "rank 2" in message and "all_reduce" in message, message
        assert after < 5, f"rank {rank} noticed the dead peer after {after:.1f}s"


def peer_silent(comm, hold):
    if comm.rank == 1:
        time.sleep(hold)  # never joins the collective
        return None
    return expect_error(lambda: comm.all_reduce(torch.ones(100)), ringcomm.CollectiveTimeoutError)


def test_timeout_when_a_peer_never_joins():
    results = run_ranks(2, peer_silent, 4.0, comm_timeout=1.5)
    message, elapsed = results[0]
    assert "Timed out" in message and "all_reduce" in message and "rank(s) 1" in message
    assert 1.0 < elapsed < 4.0


def one_rank_stuck(comm):
    """Ring of 3: rank 1 never joins; rank 2 joins late, so rank 0 (waiting on its ring
    neighbour 2, itself waiting on 1) times out first."""
    timeout = ringcomm.CollectiveTimeoutError
    if comm.rank == 1:
        time.sleep(5.0)
        return expect_error(lambda: comm.all_reduce(torch.ones(1 << 18)), timeout)[0]
    if comm.rank == 2:
        time.sleep(0.5)
    return expect_error(lambda: comm.all_reduce(torch.ones(1 << 18), algorithm="ring"), timeout)[0]


def test_a_timeout_names_the_rank_that_holds_everything_up():
    """Every rank's error names rank 1, not only the rank each one waited on directly: waiting
    ranks tell their peers on whom they wait, and the rank that times out follows the chain."""
    first, late_joiner, stuck = run_ranks(3, one_rank_stuck, comm_timeout=2.0, timeout=60)
    # Rank 0 waits on rank 2 (and over shared memory also on rank 1, its send not taken).
    assert "rank 2 waits on rank 1" in first, first
    assert "nothing from rank(s) 1: stuck or slow" in first, first
    assert "nothing from rank(s) 1: stuck or slow" in late_joiner, late_joiner
    assert "rank 1" in stuck, stuck


def receiver_of_a_blocked_rank(comm):
    """Rank 1 gathers to rank 0, then waits to receive from it; rank 0 is still in the gather,
    waiting on rank 2, which never comes. Rank 1's receive times out first (it began 0.5 s
    earlier): its error follows rank 0's waiting notices to rank 2."""
    if comm.rank == 2:
        time.sleep(4.0)
        return None
    if comm.rank == 1:
        comm.gather(torch.ones(3), None, dst=0)
        return expect_error(lambda: comm.recv(torch.empty(3), 0), ringcomm.CollectiveTimeoutError)[
            0
        ]
    time.sleep(0.5)
    outputs = [torch.empty(3) for _ in range(3)]
    return expect_error(
        lambda: comm.gather(torch.ones(3), outputs, dst=0), ringcomm.CollectiveTimeoutError
    )[0]


def test_a_receive_that_times_out_names_the_rank_that_holds_everything_up():
    """A point-to-point timeout follows the waiting notices as a collective's does."""
    root, receiver, _ = run_ranks(3, receiver_of_a_blocked_rank, comm_timeout=2.0, timeout=60)
    assert "Timed out waiting for" in receiver and "from rank 0" in receiver, receiver
    assert "rank 0 waits on rank 2" in receiver, receiver
    assert "nothing from rank(s) 2: stuck or slow" in receiver, receiver
    # the root hears rank 1's reason in its abort, or times out itself: either names rank 2
    assert "rank(s) 2" in root, root


def root_in_a_receive(comm):
    """Rank 0 waits in a broadcast on its root, rank 1, which is blocked in a receive from rank
    2, which never comes. Rank 0 times out first (rank 1 began 0.5 s later)."""
    if comm.rank == 2:
        time.sleep(4.0)
        return None
    if comm.rank == 1:
        time.sleep(0.5)
        return expect_error(lambda: comm.recv(torch.empty(3), 2))[0]
    return expect_error(lambda: comm.broadcast(torch.ones(3), 1), ringcomm.CollectiveTimeoutError)[
        0
    ]


def test_a_rank_blocked_in_a_receive_says_on_whom_it_waits():
    """A rank waiting only in sends and receives announces on whom it waits, as one in a
    collective does: a timeout that reaches it follows the chain on, to rank 2."""
    waiting, _, _ = run_ranks(3, root_in_a_receive, comm_timeout=2.0, timeout=60)
    assert "broadcast" in waiting and "waiting on rank(s) 1" in waiting, waiting
    assert "rank 1 waits on rank 2; nothing from rank(s) 2: stuck or slow" in waiting, waiting


def abort_while_a_receive_times_out(comm):
    """Rank 1's receive from rank 0 times out; while it looks for rank 0's waiting notices
    (notice_period(6 s) = 0.3 s, so for up to 0.6 s), rank 0's abort arrives. Rank 1 fails with
    rank 0's reason; the abort must not escape its progress thread (which would abort the
    process)."""
    comm.barrier()
    if comm.rank == 0:
        time.sleep(6.3)
        comm.abort("gave up")
        return None
    return expect_error(lambda: comm.recv(torch.empty(3), 0))[0]


@pytest.mark.transport_fixed
def test_an_abort_read_while_a_receive_times_out_is_the_error():
    _, message = run_ranks(
        2,
        abort_while_a_receive_times_out,
        comm_timeout=6.0,
        timeout=60,
        env={"RINGCOMM_TRANSPORT": "tcp"},
    )
    # the abort, read inside the wait for notices; or, had it come later, rank 1's own timeout
    assert "rank 0 aborted: aborted: gave up" in message or "Timed out waiting for" in message, (
        message
    )


def leaf_leaves_early(comm):
    """Rank 0 reduces from ranks 1 and 2; rank 2 comes late, so rank 0 waits long enough to send
    its peers waiting notices; rank 1, done, closes and exits with those notices unread (its
    close is then a reset)."""
    if comm.rank == 2:
        time.sleep(1.0)
    t = torch.full((1000,), float(comm.rank + 1))
    comm.reduce(t, 0)
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0's notices arrive, unread
        comm.close()  # and its process ends, while rank 0 still waits for rank 2
    return t[0].item() if comm.rank == 0 else None


def test_a_rank_that_finishes_and_exits_while_others_wait_is_no_error():
    # A 3 s timeout: notices every 150 ms.
    assert run_ranks(3, leaf_leaves_early, comm_timeout=3, timeout=60)[0] == 6.0


# ---- limits (strangers, wrong tokens and other versions: test_handshake.py) ----------------


def too_few_descriptors(store, rank, world):
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
    return expect_error(
        lambda: ringcomm.Communicator(store, rank, world, timeout=timedelta(seconds=20), name="fds")
    )[0]


@pytest.mark.transport_fixed
def test_a_descriptor_limit_too_low_for_the_mesh_is_a_clear_error():
    messages = run_ranks(
        2,
        too_few_descriptors,
        make_comm=False,
        timeout=60,
        env={"RINGCOMM_SOCKETS_PER_PEER": "64", "RINGCOMM_TRANSPORT": "tcp"},
    )
    for message in messages:
        assert "the mesh needs 64 sockets" in message and "ulimit -n" in message, message


# ---- bad arguments ------------------------------------------------------------------------


def coalesced_bad_arguments(comm):
    """(call, error, message) for the coalesced collectives, the core's list arguments too."""
    t = torch.ones(8)
    f32 = TORCH_DTYPES[torch.float32]

    def core_call(ptrs, counts, dtypes):  # the core's list arguments: buffers of uint64
        return lambda: _C.all_reduce_coalesced(
            comm._core, ptrs, counts, dtypes, 0, 1 << 20, f32, 1.0, False
        )

    return [
        (core_call([t.data_ptr()], [8], [f32]), TypeError, "incompatible function arguments"),
        (
            core_call(array("Q", [t.data_ptr()]), array("i", [8]), array("Q", [f32])),
            ValueError,
            r"counts must be a contiguous buffer of uint64 \(format Q\), got format 'i'",
        ),
        (
            core_call(array("Q", [t.data_ptr()] * 2), array("Q", [4, 4]), array("Q", [f32])),
            ValueError,
            "differ in length",
        ),
        (
            core_call(array("Q", [t.data_ptr()]), array("Q", [8]), array("Q", [1 << 40])),
            ValueError,
            "dtype",
        ),
        (lambda: comm.all_reduce_coalesced(t), TypeError, "list or tuple"),
        (
            lambda: comm.all_reduce_coalesced([t, 3]),
            TypeError,
            r"tensors\[1\] must be a torch.Tensor",
        ),
        # the C++ reader looks at items ahead of the one it checks: odd ones behind the bad one
        (
            lambda: comm.all_reduce_coalesced(
                [torch.ones(2) for _ in range(40)]
                + [3]
                + [None, torch.ones(3).to_sparse(), np.ones(2), torch.nn.Parameter(torch.ones(1))]
                * 8
            ),
            TypeError,
            r"tensors\[40\] must be a torch.Tensor",
        ),
        (
            lambda: comm.all_reduce_coalesced([t, torch.ones(4, 4).t()]),
            ValueError,
            r"tensors\[1\] must be contiguous",
        ),
        (lambda: comm.all_reduce_coalesced([t, t]), ValueError, "overlap"),
        (lambda: comm.all_reduce_coalesced([t[:5], t[4:]]), ValueError, "overlap"),
        (
            lambda: comm.all_reduce_coalesced([t, torch.ones(2, dtype=torch.int32)], op="avg"),
            TypeError,
            r"op avg needs floating dtypes, but tensors\[1\]",
        ),
        (lambda: comm.all_reduce_coalesced([t], op="xor"), ValueError, "unsupported reduce op"),
        (
            lambda: comm.all_reduce_coalesced([t], bucket_bytes=0),
            ValueError,
            "bucket_bytes must be positive",
        ),
        (
            lambda: comm.all_reduce_coalesced([t], bucket_bytes=1.5),
            TypeError,
            "bucket_bytes must be an int",
        ),
        (lambda: comm.broadcast_coalesced([t], src=7), ValueError, "src 7 out of range"),
        (lambda: comm.broadcast_coalesced([t, t[2:3]], src=0), ValueError, "overlap"),
        (
            lambda: comm.all_gather_coalesced([[t]], [torch.ones(8)]),
            ValueError,
            "output_lists must be a list of world_size",
        ),
        (
            lambda: comm.all_gather_coalesced([[torch.ones(8)], [torch.ones(7)]], [torch.ones(8)]),
            ValueError,
            r"output_lists\[1\]\[0\] has 7 elements",
        ),
        (
            lambda: comm.all_gather_coalesced(
                [[torch.ones(8, dtype=torch.float64)], [torch.ones(8)]], [torch.ones(8)]
            ),
            TypeError,
            r"output_lists\[0\]\[0\] has dtype torch.float64",
        ),
        (lambda: comm.all_gather_coalesced([[t], [t]], [torch.ones(8)]), ValueError, "overlap"),
    ]


def bad_arguments(comm):
    cases = [
        (lambda: comm.all_reduce(torch.ones(4, 4).t()), ValueError, "contiguous"),
        (lambda: comm.all_reduce(torch.ones(4, dtype=torch.complex64)), TypeError, "dtype"),
        (lambda: comm.all_reduce(torch.ones(4, device="meta")), ValueError, "CPU"),
        (lambda: comm.all_reduce([1.0, 2.0]), TypeError, "torch.Tensor"),
        (lambda: comm.all_reduce(torch.ones(4, dtype=torch.bool), op="avg"), TypeError, "bool"),
        (lambda: comm.all_reduce(torch.ones(4), op="bxor"), TypeError, "integer"),
        (lambda: comm.all_reduce(torch.ones(4), op="xor"), ValueError, "unsupported"),
        (lambda: comm.all_reduce(torch.ones(4), algorithm="magic"), ValueError, "algorithm"),
        (lambda: comm.broadcast(torch.ones(4), src=comm.world_size), ValueError, "out of range"),
        (lambda: comm.reduce(torch.ones(4), dst=-1), ValueError, "out of range"),
        (lambda: comm.send(torch.ones(4), comm.rank), ValueError, "self"),
        (lambda: comm.reduce_scatter(torch.ones(3), torch.ones(5)), ValueError, "elements"),
        (
            lambda: comm.all_gather(torch.ones(8), torch.ones(4, dtype=torch.float64)),
            TypeError,
            "dtype",
        ),
        (lambda: comm.all_gatherv(torch.ones(8), torch.ones(4), [4]), ValueError, "counts"),
    ] + coalesced_bad_arguments(comm)
    for call, error, text in cases:
        with pytest.raises(error, match=text):
            call()
    # nothing was sent: the communicator still works, the ranks agreeing on what comes next
    t = torch.ones(3)
    comm.all_reduce(t)
    x = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    comm.all_reduce_coalesced(x)
    assert comm.broken is None
    return all(bool((y == comm.world_size).all()) for y in (t, *x))


def test_bad_arguments_raise_before_sending():
    assert all(run_ranks(2, bad_arguments))


# ---- abort and signals --------------------------------------------------------------------


def abort_pending(comm, store):
    """Rank 1 joins the first all_reduce late. Rank 0 aborts while it waits: its operation, and
    one queued behind it, fail at once; rank 1, joining, hears the reason."""
    aborted = ringcomm.AbortedError
    if comm.rank == 1:
        store.wait(["test/aborted"], timedelta(seconds=30))
        message = expect_error(lambda: comm.all_reduce(torch.ones(1 << 20)), aborted)[0]
        store.set("test/heard", "1")
        return message
    running = comm.all_reduce(torch.ones(1 << 20), async_op=True)
    queued = comm.all_reduce(torch.ones(4), async_op=True)
    time.sleep(0.3)
    start = time.monotonic()
    threading.Thread(target=comm.abort, args=("preempted",)).start()  # from another thread
    first = expect_error(running.wait, aborted)[0]
    second = expect_error(queued.wait, aborted)[0]
    assert type(queued.exception()) is aborted
    elapsed = time.monotonic() - start
    after = expect_error(lambda: comm.all_reduce(torch.ones(4)), aborted)[0]
    store.set("test/aborted", "1")
    # Alive until rank 1 has heard the reason: gone, it would read a reset, not the reason.
    store.wait(["test/heard"], timedelta(seconds=30))
    start = time.monotonic()
    comm.close()  # returns at once: nothing left to finish
    return first, second, after, elapsed, time.monotonic() - start


def test_abort_fails_pending_operations_at_once_and_tells_peers():
    (first, second, after, elapsed, closed), peer = run_ranks(
        2, abort_pending, timeout=60, comm_timeout=30, with_store=True
    )
    assert "aborted: preempted" in first and "aborted: preempted" in second, (first, second)
    assert "broken" in after
    assert elapsed < 2 and closed < 1, (elapsed, closed)  # not the 30 s timeout
    assert "preempted" in peer, peer


def abort_from_completion_callback(comm, store):
    """Rank 1 aborts from the callback of an all_reduce that completed (as a DDP hook does when
    its next step fails): abort() returns having told the peers, so rank 1 may exit at once."""
    if comm.rank == 0:
        # Rank 1's callback is in place before its all_reduce can complete.
        store.wait(["test/armed"], timedelta(seconds=30))
        comm.all_reduce(torch.ones(4))
        return expect_error(lambda: comm.all_reduce(torch.ones(4)), ringcomm.AbortedError)
    seen = []

    def callback(future):  # on the progress thread, as the all_reduce completes
        comm.abort("stopped in a callback")
        seen.append(comm.broken)

    done = comm.all_reduce(torch.ones(4), async_op=True).get_future().then(callback)
    store.set("test/armed", "1")
    done.wait()
    return seen[0]


def test_abort_from_a_completion_callback_tells_the_peers_before_returning():
    (message, elapsed), broken = run_ranks(
        2, abort_from_completion_callback, timeout=60, comm_timeout=30, with_store=True
    )
    # Broken as abort() returns, not once the progress thread comes round to it: a process
    # exiting right after the callback must not leave its peers reading a bare close.
    assert broken and "aborted: stopped in a callback" in broken, broken
    assert "stopped in a callback" in message and elapsed < 2, (message, elapsed)


def abort_then_exit(comm, store):
    """Rank 1 aborts from its main thread and exits at once (os._exit): abort() returns only once
    the peers are told, so rank 0, waiting on a receive from it, reads the reason, not a closed
    connection."""
    t = torch.ones(4)
    if comm.rank == 1:
        store.wait(["test/waiting"], timedelta(seconds=30))
        comm.abort("gone on purpose")
        os._exit(0)
    work = comm.irecv(t, 1)
    store.set("test/waiting", "1")
    return expect_error(work.wait)


def test_abort_then_exit_at_once_leaves_the_peer_the_reason():
    # abort() used to return once the communicator was broken, before the progress thread had
    # told the peers: 8 pairs in 50 read "Connection closed by peer (rank 1 ...)" or "(reason not
    # received)" (the flaky PowerSGD test's [prepare] case). A few pairs, so that it shows.
    for _ in range(8):
        (message, elapsed), _ = run_ranks(
            2, abort_then_exit, timeout=60, comm_timeout=30, with_store=True, allow_errors=True
        )
        assert "gone on purpose" in message and elapsed < 2, (message, elapsed)


def send_then_abort(comm, store):
    """Rank 1 sends, then aborts; rank 0 receives only after both: the message it already holds
    arrives, the next receive fails with rank 1's reason."""
    if comm.rank == 1:
        comm.send(torch.arange(100.0), 0)
        comm.abort("stopped after sending")
        store.set("test/aborted", "1")
        # Alive until rank 0 has read both: gone, it would read a close.
        store.wait(["test/heard"], timedelta(seconds=30))
        return None
    store.wait(["test/aborted"], timedelta(seconds=30))
    t = torch.zeros(100)
    comm.recv(t, 1)
    message, elapsed = expect_error(lambda: comm.recv(torch.zeros(100), 1))
    store.set("test/heard", "1")
    return t, message, elapsed


def test_what_a_peer_sent_before_aborting_still_arrives():
    (t, message, elapsed), _ = run_ranks(
        2, send_then_abort, timeout=60, comm_timeout=30, with_store=True
    )
    assert torch.equal(t, torch.arange(100.0))
    assert "stopped after sending" in message and elapsed < 2, (message, elapsed)


def abort_blocking_call(comm, store):
    """A blocking call runs on the caller's thread; abort from a timer thread interrupts it."""
    if comm.rank == 1:
        # Alive, never joining, until rank 0 has its error: gone, it would read a close.
        store.wait(["test/interrupted"], timedelta(seconds=30))
        return None
    threading.Timer(0.3, comm.abort, args=("stop",)).start()
    start = time.monotonic()
    message = expect_error(lambda: comm.all_reduce(torch.ones(8)))[0]
    elapsed = time.monotonic() - start
    store.set("test/interrupted", "1")
    return message, elapsed


def test_abort_interrupts_a_blocking_call_on_another_thread():
    (message, elapsed), _ = run_ranks(
        2, abort_blocking_call, timeout=60, comm_timeout=30, with_store=True
    )
    assert "aborted: stop" in message and elapsed < 2, (message, elapsed)


def signal_during_wait(comm):
    """A signal handler runs while Work.wait() waits for an operation a peer never joins."""
    if comm.rank == 1:
        time.sleep(2.0)
        return None
    return seconds_until_handler_runs(comm.all_reduce(torch.ones(4), async_op=True))


def test_work_wait_lets_signal_handlers_run():
    elapsed, _ = run_ranks(2, signal_during_wait, timeout=60, comm_timeout=30, allow_errors=True)
    assert isinstance(elapsed, float) and elapsed < 1.0, elapsed
