"""The shared-memory transport: chosen between local ranks, refused or replaced cleanly, and a
killed rank leaves nothing behind while the others raise at once."""

import os
import signal
import subprocess
import time

import pytest
import torch

import ringcomm
from ranks import build_native, run_ranks


def transports(comm):
    return comm.transports


@pytest.mark.parametrize(
    "env_of,expected",
    [
        (lambda r: {}, lambda r, n: ["self" if q == r else "shm" for q in range(n)]),
        (
            lambda r: {"RINGCOMM_TRANSPORT": "tcp"},
            lambda r, n: ["self" if q == r else "tcp" for q in range(n)],
        ),
        # two fake hosts of two ranks: shared memory inside each, TCP between them
        (
            lambda r: {"RINGCOMM_HOST_ID": f"h{r // 2}"},
            lambda r, n: [
                "self" if q == r else "shm" if q // 2 == r // 2 else "tcp" for q in range(n)
            ],
        ),
        # rank 1 runs without shared memory: TCP with it, shared memory among the others
        (
            lambda r: {"RINGCOMM_TRANSPORT": "tcp"} if r == 1 else {},
            lambda r, n: ["self" if q == r else "tcp" if 1 in (q, r) else "shm" for q in range(n)],
        ),
    ],
)
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
    ranks.TRANSPORTS = {
        "auto": lambda r: {"RINGCOMM_SHM_SLOTS": str(4 + 4 * r)},
        "shm": lambda r: {"RINGCOMM_SHM_SLOTS": str(4 + 4 * r), "RINGCOMM_TRANSPORT": "shm"},
    }
    try:
        ranks.transport = "auto"
        assert run_ranks(2, slots_differ) == [["self", "tcp"], ["tcp", "self"]]
        ranks.transport = "shm"
        results = run_ranks(2, slots_differ, allow_errors=True, timeout=60)
    finally:
        ranks.TRANSPORTS, ranks.transport = saved
    for status, text in results:
        assert (
            status == "error" and "RINGCOMM_TRANSPORT=shm" in text and "cannot share memory" in text
        ), text


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


# By default (RINGCOMM_TUNING=off in tests: single copy kept unprobed) 2 ranks move the 1 MiB
# slices of their 2 MiB halves by single copy, 3 and 4 their 512 KiB ones; 4 KiB forces it on
# small messages too.
@pytest.mark.serial  # compares /dev/shm before and after, which other tests' processes change
@pytest.mark.parametrize("world,single_copy", [(2, None), (3, None), (4, None), (4, "4096")])
def test_killed_rank_leaves_nothing_and_the_others_raise_within_a_second(
    world, single_copy, tmp_path
):
    before = set(os.listdir("/dev/shm"))
    env = {"RINGCOMM_SHM_SINGLE_COPY_BYTES": single_copy} if single_copy else None
    results = run_ranks(
        world,
        die_in_the_middle,
        world - 1,
        str(tmp_path),
        allow_errors=True,
        timeout=60,
        comm_timeout=30,
        env=env,
    )
    killed_at = float((tmp_path / "killed").read_text())
    for rank, result in enumerate(results[:-1]):
        assert result is not None and result[0] != "error", f"rank {rank}: {result}"
        raised_at, message = result
        assert raised_at - killed_at < 1.5, (
            f"rank {rank} noticed after {raised_at - killed_at:.2f}s"
        )
        assert "rank" in message, message
    assert results[-1][0] == "error"  # the victim reports no result
    assert set(os.listdir("/dev/shm")) <= before  # memfd segments have no name to leave behind


def large_and_odd_sizes(comm):
    out = []
    for n in (0, 1, 16383, 16384 + 7, (1 << 20) + 3):  # around slot boundaries
        t = torch.arange(n, dtype=torch.float64) * (comm.rank + 1)
        comm.all_reduce(t)
        out.append(
            torch.equal(
                t, torch.arange(n, dtype=torch.float64) * sum(range(1, comm.world_size + 1))
            )
        )
    return out


@pytest.mark.parametrize("slot_bytes", ["4096", "65536"])
def test_messages_across_slot_boundaries(slot_bytes):
    for result in run_ranks(
        3,
        large_and_odd_sizes,
        env={"RINGCOMM_SHM_SLOT_BYTES": slot_bytes, "RINGCOMM_SHM_SLOTS": "2"},
    ):
        assert all(result), result


def by_single_copy(comm):
    """Collectives whose messages are large enough for single copy; each result checked exactly,
    and how many bytes this rank read out of its peers' memory."""
    before = ringcomm.shm_bytes_read()
    n, r, w = (1 << 18) + 5, comm.rank, comm.world_size  # ~1 MiB of float32, not divisible by w
    ok = []
    base = torch.arange(n, dtype=torch.float32) % 7
    for algo in ("ring", "tree", "recursive_doubling"):
        t = base + r
        comm.all_reduce(t, algorithm=algo)
        ok.append(torch.equal(t, base * w + sum(range(w))))
    m = n - n % w
    out = torch.empty(m * w)
    comm.all_gather(out, base[:m] + r)
    ok.append(torch.equal(out, torch.cat([base[:m] + q for q in range(w)])))
    part = torch.empty(m // w)
    comm.reduce_scatter(part, base[:m] + r)
    ok.append(torch.equal(part, (base[:m] * w + sum(range(w)))[r * (m // w) : (r + 1) * (m // w)]))
    t = base + r
    comm.broadcast(t, 1)
    ok.append(torch.equal(t, base + 1))
    got = torch.empty(n)
    works = [comm.irecv(got, (r - 1) % w), comm.isend(base * (r + 1), (r + 1) % w)]
    for work in works:
        work.wait()
    ok.append(torch.equal(got, base * ((r - 1) % w + 1)))
    # Coalesced: its parts travel as ranges of the tensors, read by single copy straight out of
    # the sender's tensors (or through the slots where it is off).
    tensors = [torch.full((40_000 + 1000 * i,), float(r + i)) for i in range(20)]
    comm.all_reduce_coalesced(tensors)
    ok.append(
        all(
            torch.equal(x, torch.full_like(x, float(sum(range(w)) + w * i)))
            for i, x in enumerate(tensors)
        )
    )
    # Views of one buffer with gaps of just under a page (the reader takes such neighbours in one
    # read and throws the gap away) and of a page (read apart): the gaps keep their values.
    buffer = torch.full((40 * 21024,), -1.0 - r)
    views = [buffer[i * 21024 : i * 21024 + 20000 + 24 * (i % 2)] for i in range(40)]
    for i, v in enumerate(views):
        v.fill_(r + i)
    comm.all_reduce_coalesced(views)
    gaps = torch.ones_like(buffer, dtype=torch.bool)
    for i, v in enumerate(views):
        gaps[i * 21024 : i * 21024 + v.numel()] = False
    ok.append(
        all(
            torch.equal(v, torch.full_like(v, float(sum(range(w)) + w * i)))
            for i, v in enumerate(views)
        )
    )
    ok.append(bool(torch.all(buffer[gaps] == -1.0 - r)))
    return ok, ringcomm.shm_bytes_read() - before


def coalesced_alone(comm):
    before = ringcomm.shm_bytes_read()
    r, w = comm.rank, comm.world_size
    tensors = [torch.full((17000 + 17 * i,), float(r * i)) for i in range(60)]
    comm.all_reduce_coalesced(tensors)
    ok = all(
        torch.equal(x, torch.full_like(x, float(i * sum(range(w))))) for i, x in enumerate(tensors)
    )
    return ok, ringcomm.shm_bytes_read() - before


def test_coalesced_reads_the_tensors_in_place():
    """A coalesced all-reduce alone through the pipeline (a forced algorithm other than the
    shared buffer: at 3 ranks auto takes the boards), with single copy on: the parts, tensors of
    68 KB, are read out of the peers' tensors (bytes read by single copy), with the same results
    as through the slots."""
    for setting in ("4096", "0"):
        for r, (ok, read) in enumerate(
            run_ranks(
                3,
                coalesced_alone,
                env={
                    "RINGCOMM_SHM_SINGLE_COPY_BYTES": setting,
                    "RINGCOMM_TRANSPORT": "shm",
                    "RINGCOMM_ALGO": "ring",
                },
            )
        ):
            assert ok, (setting, r)
            assert (read > 0) == (setting != "0"), (setting, r, read)


def small_buffers_by_layout(comm):
    """Two coalesced all-reduces of 1000 buffers of 4 KiB: views one after another in one buffer,
    then views a stride of 12 KiB apart. Returns, for each, whether the results (and the gaps)
    are right and the bytes read by single copy."""
    r, w = comm.rank, comm.world_size
    out = []
    for stride in (1024, 3 * 1024):  # float32 elements: packed, then 8 KiB gaps
        buffer = torch.full((1000 * stride,), -1.0 - r)
        views = [buffer[i * stride : i * stride + 1024] for i in range(1000)]
        for i, v in enumerate(views):
            v.fill_(r + i % 7)
        before = ringcomm.shm_bytes_read()
        comm.all_reduce_coalesced(views)
        read = ringcomm.shm_bytes_read() - before
        ok = all(
            torch.equal(v, torch.full_like(v, float(sum(range(w)) + w * (i % 7))))
            for i, v in enumerate(views)
        )
        if stride > 1024:
            ok = ok and bool(torch.all(buffer.view(1000, stride)[:, 1024:] == -1.0 - r))
        out.append((ok, read))
    return out


def test_small_buffers_go_by_single_copy_where_they_lie_together():
    """Where ranks send by single copy, a bucket of small buffers is cut into parts as large as
    the flat all-reduce's, and each part goes by single copy if its buffers lie together (views
    of one buffer: read as one range) and through the slots if they do not (a page or more
    apart: the kernel would pin them one by one). The threshold, 512 KiB, is above the slots'
    128 KiB messages: only parts of the ring's size (1 MiB with 2 ranks) pass it."""
    for r, ((packed_ok, packed_read), (spread_ok, spread_read)) in enumerate(
        run_ranks(
            2,
            small_buffers_by_layout,
            env={"RINGCOMM_SHM_SINGLE_COPY_BYTES": "524288", "RINGCOMM_TRANSPORT": "shm"},
        )
    ):
        assert packed_ok and spread_ok, r
        assert packed_read >= 2 << 20, (r, packed_read)  # half of the 4 MiB, at least
        assert spread_read == 0, (r, spread_read)


@pytest.mark.parametrize(
    "setting,reads",
    [
        # on for every rank: everyone reads its peers' large messages
        (lambda r: "4096", lambda r: True),
        # off for every rank: only slots
        (lambda r: "0", lambda r: False),
        # on for even ranks only: the two kinds of message mix on one channel; the ring's rank r
        # receives from r-1, so odd ranks read their even senders' memory
        (lambda r: "4096" if r % 2 == 0 else "0", lambda r: True if r % 2 else None),
    ],
)
def test_single_copy_gives_the_same_results_and_mixes_with_slots(setting, reads):
    results = run_ranks(
        4,
        by_single_copy,
        per_rank_env={
            r: {"RINGCOMM_SHM_SINGLE_COPY_BYTES": setting(r), "RINGCOMM_TRANSPORT": "shm"}
            for r in range(4)
        },
    )
    for r, (ok, read) in enumerate(results):
        assert all(ok), (r, ok)
        if reads(r) is not None:
            assert (read > 0) == reads(r), (r, read)


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` in this process (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                begin, end = (int(x, 16) for x in head.split("-"))
                inside = begin <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def kernel_collapses() -> bool:
    """Whether madvise(MADV_COLLAPSE) (Linux 6.1) works here, on 4 MiB of this process."""
    import ctypes
    import mmap

    buf = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"x" * (4 << 20))
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    region = (address + (2 << 20) - 1) & ~((2 << 20) - 1)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(region, 2 << 20, 25) == 0


def huge_pages_over_three_calls(comm, kind):
    """A 16 MiB tensor all-reduced three times, single copy on, as one tensor ("flat") or as
    1024 views of 16 KiB (all_reduce_coalesced: single copy reads them as one run): after each
    call, whether the values are right and the kB of its mapping in huge pages; the bytes read by
    single copy; and what RINGCOMM_DEBUG said of collapses that failed (this rank was forked from
    a process that imported ringcomm without it, so the core's lines are taken here, not from
    the logger)."""
    lines = []
    ringcomm._C.set_log_sink(lines.append)
    before = ringcomm.shm_bytes_read()
    r, w = comm.rank, comm.world_size
    t = torch.empty(4 << 20)
    views = list(t.split(4096))
    seen = []
    for call in range(3):
        t.fill_(float(r + call))
        if kind == "flat":
            comm.all_reduce(t)
        else:
            comm.all_reduce_coalesced(views)
        seen.append(
            (bool(torch.all(t == float(sum(range(w)) + w * call))), anon_huge_kb(t.data_ptr()))
        )
    ringcomm._C.set_log_sink(None)
    return seen, ringcomm.shm_bytes_read() - before, [x for x in lines if "MADV_COLLAPSE" in x]


@pytest.mark.parametrize("kind", ["flat", "views"])
@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_buffer_sent_again_by_single_copy_moves_into_huge_pages(setting, kind):
    """Peers pin a single-copy sender's pages one by one: a buffer all-reduced a second time has
    its memory collapsed into huge pages (csrc/transport/shm/huge_pages.h), the values unchanged;
    one seen once is left alone, and RINGCOMM_SHM_HUGE_PAGES=0 leaves every buffer alone. The
    same holds for a coalesced list of views that lie together in it."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as thp:
        if "[always]" in thp.read():  # tensors start on huge pages: nothing to tell apart
            pytest.skip("transparent huge pages are 'always' here")
    if setting == "1" and not kernel_collapses():
        pytest.skip("this kernel has no madvise(MADV_COLLAPSE)")
    results = run_ranks(
        2,
        huge_pages_over_three_calls,
        kind,
        env={
            "RINGCOMM_SHM_SINGLE_COPY_BYTES": "524288",
            "RINGCOMM_TRANSPORT": "shm",
            "RINGCOMM_SHM_HUGE_PAGES": setting,
            "THP_MEM_ALLOC_ENABLE": "0",
            "RINGCOMM_DEBUG": "INFO",
        },
    )
    for r, (seen, read, failures) in enumerate(results):
        assert read > 0, r
        assert all(ok for ok, _ in seen), (r, seen)
        assert seen[0][1] == 0, (r, seen)  # seen once: a temporary, maybe
        # The machine's memory, not ringcomm: no free 2 MiB page to collapse into.
        short = [
            line
            for line in failures
            if "temporarily unavailable" in line or "Cannot allocate memory" in line
        ]
        if setting == "1" and short:
            pytest.skip(f"rank {r}: the kernel found no free huge page: {short[0]}")
        assert setting == "1" or not failures, (r, failures)  # 0: nothing asked
        if setting == "1":
            # the 2 MiB regions wholly inside 16 MiB: 7 at least, whatever its alignment
            assert seen[1][1] >= 7 * 2048 and seen[2][1] >= 7 * 2048, (r, seen, failures)
        else:
            assert seen[1][1] == seen[2][1] == 0, (r, seen)


def test_huge_pages_setting_is_checked():
    results = run_ranks(
        2, transports, allow_errors=True, timeout=60, env={"RINGCOMM_SHM_HUGE_PAGES": "2"}
    )
    for status, text in results:
        assert status == "error" and "RINGCOMM_SHM_HUGE_PAGES must be 0 or 1" in text, text


def test_single_copy_setting_is_checked():
    results = run_ranks(
        2, transports, allow_errors=True, timeout=60, env={"RINGCOMM_SHM_SINGLE_COPY_BYTES": "-5"}
    )
    for status, text in results:
        assert status == "error" and "RINGCOMM_SHM_SINGLE_COPY_BYTES must be >= 0" in text, text


def single_copy_within(store, rank, world, cpus_of, nbytes):
    """Bytes read by single copy in a ring all-reduce of `nbytes` by a communicator made while
    this process may run only on cpus_of[rank]."""
    from datetime import timedelta

    os.sched_setaffinity(0, cpus_of[rank])
    comm = ringcomm.Communicator(store, rank, world, timeout=timedelta(seconds=30))
    before = ringcomm.shm_bytes_read()
    t = torch.ones(nbytes // 4)
    comm.all_reduce(t, algorithm="ring")
    read = ringcomm.shm_bytes_read() - before
    comm.close()
    return bool(torch.all(t == world)), read


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_single_copy_default_is_the_rings_slice_with_or_without_a_cpu_each():
    # The default threshold is the ring's slice: 2 ranks' 2 MiB all-reduce (1 MiB halves) goes by
    # single copy, their 1 MiB one (512 KiB halves) through the slots; 4 ranks' 2 MiB one
    # (512 KiB quarters) by single copy. Whether ranks share CPUs does not decide it: the link
    # probe measures it both ways (test_single_copy_is_kept_only_where_measured_faster).
    a, b = sorted(os.sched_getaffinity(0))[:2]
    for world, cpus, nbytes, reads in (
        (2, [{a}, {b}], 2 << 20, True),
        (2, [{a}, {a}], 2 << 20, True),
        (2, [{a}, {b}], 1 << 20, False),
        (4, [{a}, {b}, {a}, {b}], 2 << 20, True),
    ):
        results = run_ranks(
            world,
            single_copy_within,
            dict(enumerate(cpus)),
            nbytes,
            make_comm=False,
            env={"RINGCOMM_TRANSPORT": "shm"},
        )
        for ok, read in results:
            assert ok and (read > 0) == reads, (world, cpus, nbytes, ok, read)


def single_copy_kept(store, rank, world):
    """The link model's single-copy verdict, and the bytes read by single copy in a 4 MiB
    all-reduce."""
    from datetime import timedelta

    comm = ringcomm.Communicator(store, rank, world, timeout=timedelta(seconds=30))
    before = ringcomm.shm_bytes_read()
    t = torch.ones(1 << 20)
    comm.all_reduce(t)
    read = ringcomm.shm_bytes_read() - before
    verdict = comm.link_model()["single_copy"]
    comm.close()
    return bool(torch.all(t == world)), verdict, read


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_single_copy_is_kept_only_where_measured_faster(tmp_path):
    # Which way is faster depends on the machine; what must hold is that the ranks agree, follow
    # the verdict and save it, and that a saved verdict is followed both ways unless
    # RINGCOMM_SHM_SINGLE_COPY_BYTES is set by hand.
    path = tmp_path / "links"
    env = {"RINGCOMM_TRANSPORT": "shm", "RINGCOMM_TUNING": str(path)}
    results = run_ranks(2, single_copy_kept, make_comm=False, env=env)
    verdict = results[0][1]
    for ok, agreed, read in results:
        assert ok and agreed == verdict and (read > 0) == verdict, results
    assert f"single_copy {int(verdict)}" in path.read_text()
    for saved, by_hand, reads in ((1, None, True), (0, None, False), (0, "1048576", True)):
        path.write_text(
            f"alpha_us 1\nbytes_per_s 1e10\nreduce_bytes_per_s 1e10\nsingle_copy {saved}\n"
        )
        case = dict(env, **({"RINGCOMM_SHM_SINGLE_COPY_BYTES": by_hand} if by_hand else {}))
        for ok, _, read in run_ranks(2, single_copy_kept, make_comm=False, env=case):
            assert ok and (read > 0) == reads, (saved, by_hand, read)


def test_stream_copy_writes_what_memcpy_writes(tmp_path):
    """Slot fragments written with non-temporal stores (csrc/transport/shm/stream_copy.h): every
    alignment and the lengths around its head, body and tail, against memcpy, in one process."""
    binary = build_native("stream_copy", str(tmp_path))
    run = subprocess.run([binary], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


def streamed_collectives(comm):
    """all_reduce of several sizes (fragments under and over SlotWriter::kLeastBytes, a ragged
    tail), a coalesced all_reduce (slots filled from ranges) and one scaled on the way out as
    GradientAverager's is (slots filled by the packing kernel, or packed aside and streamed),
    exact values checked."""
    from ringcomm import _C, fusion

    r, w = comm.rank, comm.world_size
    for n in (5, 4099, 70_001, 1_000_003):
        t = torch.arange(n, dtype=torch.float64).remainder(7).float() + r
        comm.all_reduce(t)
        want = torch.arange(n, dtype=torch.float64).remainder(7).float() * w + sum(range(w))
        assert torch.equal(t, want), n
    tensors = [torch.full((c,), float(r + 1)) for c in (3, 5000, 20_001, 64 << 10)]
    comm.all_reduce_coalesced(tensors)
    assert all(torch.all(t == float(sum(range(1, w + 1)))) for t in tensors)
    scaled = [torch.full((c,), float(r + 1)) for c in (7, 20_001, 64 << 10, 300_000)]
    bufs = fusion.BufferList(scaled)
    _C.all_reduce_coalesced(
        comm._core,
        bufs.ptrs,
        bufs.counts,
        bufs.dtypes,
        0,
        fusion.DEFAULT_BUCKET_BYTES,
        fusion.FLOAT32,
        0.5,
        False,
    )
    assert all(torch.all(t == 0.5 * sum(range(1, w + 1))) for t in scaled)
    return True


@pytest.mark.parametrize("stream", ["1", "0", "auto"])
def test_slots_written_by_streaming_stores_carry_the_same_values(stream):
    assert all(
        run_ranks(
            3,
            streamed_collectives,
            timeout=120,
            env={
                "RINGCOMM_TRANSPORT": "shm",
                "RINGCOMM_SHM_SINGLE_COPY_BYTES": "0",
                "RINGCOMM_SHM_STREAM": stream,
            },
        )
    )


def test_stream_setting_is_checked():
    results = run_ranks(
        2, transports, allow_errors=True, timeout=60, env={"RINGCOMM_SHM_STREAM": "sometimes"}
    )
    for status, text in results:
        assert (
            status == "error"
            and "RINGCOMM_SHM_STREAM=sometimes: expected one of auto, 0, or 1" in text
        ), text


@pytest.fixture(scope="module")
def forged_ranges(tmp_path_factory):
    return build_native("forged_ranges", str(tmp_path_factory.mktemp("native")))


@pytest.mark.parametrize(
    "case,expected",
    [
        ("honest", "ok"),
        (
            "short",
            "error: protocol error: rank 1's ranges hold 150000 bytes of a message of 200000",
        ),
        ("long", "error: protocol error: rank 1's ranges hold 400000 bytes of a message of 200000"),
        # the second range moved to an address the sender has not mapped: the kernel stops there
        (
            "address",
            "error: cannot read rank 1's message of 200000 bytes at 0x1000: "
            "read 100000 of 200000 bytes",
        ),
        # the slot's count rewritten in shared memory: more ranges than the message has bytes
        (
            "count",
            "error: protocol error: rank 1 offered 200001 ranges for a message of 200000 bytes",
        ),
    ],
)
def test_a_range_list_changed_after_it_was_published_is_an_error(forged_ranges, case, expected):
    """A single-copy message's list of ranges is read out of the sender's memory: a sender that
    changes it after publishing it (tests/native/forged_ranges.cc, two processes over real shared
    memory) gets a clear error on the receiver, never a read past the message."""
    run = subprocess.run([forged_ranges, case], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected, run.stdout
