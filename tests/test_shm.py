"""The shared-memory transport: chosen between local ranks, refused or replaced cleanly, and a
killed rank leaves nothing behind while the others raise at once."""
import os
import signal
import time

import pytest
import torch

import ringcomm
from ranks import run_ranks


def transports(comm):
    return comm.transports


@pytest.mark.parametrize("env_of,expected", [
    (lambda r: {}, lambda r, n: ["self" if q == r else "shm" for q in range(n)]),
    (lambda r: {"RINGCOMM_TRANSPORT": "tcp"}, lambda r, n: ["self" if q == r else "tcp" for q in range(n)]),
    # two fake hosts of two ranks: shared memory inside each, TCP between them
    (lambda r: {"RINGCOMM_HOST_ID": f"h{r // 2}"},
     lambda r, n: ["self" if q == r else "shm" if q // 2 == r // 2 else "tcp" for q in range(n)]),
])
def test_transport_choice(env_of, expected):
    import ranks
    saved = ranks.TRANSPORTS, ranks.transport
    ranks.TRANSPORTS, ranks.transport = {"case": env_of}, "case"
    try:
        got = run_ranks(4, transports)
    finally:
        ranks.TRANSPORTS, ranks.transport = saved
    assert got == [expected(r, 4) for r in range(4)]


def slots_differ(comm):
    return comm.transports


def test_segment_that_cannot_be_mapped_falls_back_to_tcp_or_fails_when_shm_is_forced():
    import ranks
    saved = ranks.TRANSPORTS, ranks.transport
    # Different slot counts give segments of different sizes: the peers refuse each other's.
    ranks.TRANSPORTS = {"auto": lambda r: {"RINGCOMM_SHM_SLOTS": str(4 + 4 * r)},
                        "shm": lambda r: {"RINGCOMM_SHM_SLOTS": str(4 + 4 * r),
                                          "RINGCOMM_TRANSPORT": "shm"}}
    try:
        ranks.transport = "auto"
        assert run_ranks(2, slots_differ) == [["self", "tcp"], ["tcp", "self"]]
        ranks.transport = "shm"
        results = run_ranks(2, slots_differ, allow_errors=True, timeout=60)
    finally:
        ranks.TRANSPORTS, ranks.transport = saved
    for status, text in results:
        assert status == "error" and "RINGCOMM_TRANSPORT=shm" in text and "cannot share memory" in text, text


def die_in_the_middle(comm, victim, stamp_dir):
    x = torch.ones(1 << 20)
    for i in range(10_000):
        if comm.rank == victim and i == 20:
            with open(os.path.join(stamp_dir, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(x, op="max")
        except ringcomm.RingcommError as e:
            return time.time(), str(e)
    return None


@pytest.mark.parametrize("world", [2, 3, 4])
def test_killed_rank_leaves_nothing_and_the_others_raise_within_a_second(world, tmp_path):
    before = set(os.listdir("/dev/shm"))
    results = run_ranks(world, die_in_the_middle, world - 1, str(tmp_path), allow_errors=True,
                        timeout=60, comm_timeout=30)
    killed_at = float((tmp_path / "killed").read_text())
    for rank, result in enumerate(results[:-1]):
        assert result is not None and result[0] != "error", f"rank {rank}: {result}"
        raised_at, message = result
        assert raised_at - killed_at < 1.5, f"rank {rank} noticed after {raised_at - killed_at:.2f}s"
        assert "rank" in message, message
    assert results[-1][0] == "error"  # the victim reports no result
    assert set(os.listdir("/dev/shm")) <= before  # memfd segments have no name to leave behind


def large_and_odd_sizes(comm):
    out = []
    for n in (0, 1, 16383, 16384 + 7, (1 << 20) + 3):  # around slot boundaries
        t = torch.arange(n, dtype=torch.float64) * (comm.rank + 1)
        comm.all_reduce(t)
        out.append(torch.equal(t, torch.arange(n, dtype=torch.float64) * sum(range(1, comm.world_size + 1))))
    return out


@pytest.mark.parametrize("slot_bytes", ["4096", "65536"])
def test_messages_across_slot_boundaries(slot_bytes):
    for result in run_ranks(3, large_and_odd_sizes, env={"RINGCOMM_SHM_SLOT_BYTES": slot_bytes,
                                                          "RINGCOMM_SHM_SLOTS": "2"}):
        assert all(result), result
