"""Completion callbacks run on the progress thread: what they may and may not do."""

import threading
import time

import torch

import ringcomm
from ranks import run_ranks


def pending_recv(comm, callback):
    """Rank 0 attaches `callback` to a receive rank 1 satisfies only later, so the callback runs
    on rank 0's progress thread (a callback added to a finished operation runs at once, here)."""
    t = torch.zeros(10)
    if comm.rank == 0:
        return comm.recv(t, src=1, async_op=True).get_future().then(callback)
    time.sleep(0.3)
    comm.send(torch.ones(10), dst=0)
    return None


def blocking_call_in_callback(comm):
    caught = []

    def callback(fut):
        caught.append(("on progress thread", comm._core.on_progress_thread()))
        try:
            comm.all_reduce(torch.ones(10))  # blocking: would wait for this very thread
        except ringcomm.RingcommError as e:
            caught.append(str(e))
        comm.all_reduce(torch.ones(10), async_op=True)  # fine: queued behind this one
        return fut.value()

    fut = pending_recv(comm, callback)
    if fut is not None:
        fut.wait()
    else:
        comm.all_reduce(torch.ones(10))  # matches rank 0's async call from the callback
    after = torch.full((10,), float(comm.rank))
    comm.all_reduce(after)  # sequence numbers still agree
    return caught, after[0].item(), comm.broken


def test_blocking_call_from_a_callback_raises_and_the_communicator_stays_usable():
    (caught, value, broken), (_, value1, broken1) = run_ranks(
        2, blocking_call_in_callback, timeout=30
    )
    assert caught[0] == ("on progress thread", True), caught
    assert len(caught) == 2 and "would wait for itself" in caught[1], caught
    assert value == value1 == 1.0 and broken is None and broken1 is None


def close_in_callback(comm):
    done = threading.Event()

    def callback(fut):
        comm.close()  # must not join its own thread
        done.set()
        return fut.value()

    if pending_recv(comm, callback) is None:
        return "sender"
    assert done.wait(20)
    try:
        comm.all_reduce(torch.ones(3))
        refused = None
    except (ValueError, ringcomm.RingcommError) as e:
        refused = str(e)
    comm.close()  # from this thread: joins the progress thread and closes connections
    return refused


def test_close_from_a_callback_does_not_terminate():
    refused, sender = run_ranks(2, close_in_callback, timeout=30)
    assert refused and "closed" in refused and sender == "sender", refused


def concurrent_close(comm):
    comm.all_reduce(torch.ones(100))
    errors = []

    def close():
        try:
            comm._core.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors, any(t.is_alive() for t in threads)


def test_concurrent_close_calls_all_return():
    for errors, stuck in run_ranks(3, concurrent_close, timeout=30):
        assert not errors and not stuck, errors
