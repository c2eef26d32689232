"""A process forked after init (a DataLoader worker) neither uses nor closes the parent's
connections, and exits without hanging."""

import atexit
import os
import select

import torch

import ringcomm
from ranks import run_ranks


def fork_a_child(comm):
    t = torch.ones(10)
    comm.all_reduce(t)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one byte, never return into the test harness
        code = 9
        try:
            try:
                comm.all_reduce(torch.ones(10))
                code = 2  # it must not have worked
            except ringcomm.RingcommError as e:
                code = 0 if "forked" in str(e) else 3
            atexit._run_exitfuncs()  # what a child that exits normally runs: must not hang
            comm.close()
        finally:
            os.write(write_end, bytes([code]))
            os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 20)
    child = os.read(read_end, 1) if ready else b"hang"
    os.waitpid(pid, 0)
    t = torch.full((10,), float(comm.rank))
    comm.all_reduce(t)  # the parent's connections are intact
    return child, t[0].item()


def test_forked_child_leaves_the_parents_communicator_alone():
    for child, value in run_ranks(2, fork_a_child, timeout=60):
        assert child == b"\x00", child
        assert value == 1.0
