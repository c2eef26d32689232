"""The timeline (ringcomm.trace), statistics (Communicator.stats, Work.stats, per DDP bucket) and
the core's log lines through Python's logging."""

import json
import os
import subprocess
import sys

import pytest
import torch

import ringcomm
from ringcomm import _C, trace
from ranks import free_port, run_ranks, run_torchrun

TIMELINE = os.path.join(os.path.dirname(__file__), "..", "bench", "timeline.py")


def spans(events, name, pid=None):
    return [
        e
        for e in events
        if e["ph"] == "X" and e["name"] == name and (pid is None or e["pid"] == pid)
    ]


# Timestamps are wall-clock microseconds (ranks on other hosts have other monotonic clocks): about
# 1.8e15, where a double's step is 0.25 us. A span that ends within a quarter microsecond of its
# parent (the sparse all-reduce's decode, its last step) may seem to end after it.
RESOLUTION_US = 0.5


def inside(child, parent):
    return (
        child["pid"] == parent["pid"]
        and child["tid"] == parent["tid"]
        and parent["ts"] <= child["ts"] + RESOLUTION_US
        and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + RESOLUTION_US
    )


def _traced_ops(comm, path):
    trace.start(path)
    big = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: the ring, in slices
    comm.all_reduce(big, algorithm="ring")
    comm.all_reduce_coalesced([torch.ones(100 + i) for i in range(20)])
    indices = torch.tensor([comm.rank, 10 + comm.rank], dtype=torch.int32)
    comm.sparse_all_reduce(indices, torch.ones(2), 1000, algorithm="sparse_gather")
    return trace.stop()


def test_timeline_has_each_collective_its_phases_and_every_rank(tmp_path):
    path = str(tmp_path / "run.json")
    written = run_ranks(2, _traced_ops, path, env={"WORLD_SIZE": "2", "MASTER_PORT": "1"})
    assert path in written  # the last rank to finish merged the parts
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"]
    assert data["otherData"]["ringcomm_ranks"] == [0, 1]
    assert data["otherData"]["ringcomm_dropped_events"] == 0
    for rank in (0, 1):
        (ring,) = spans(events, "all_reduce", rank)
        assert ring["args"]["algorithm"] == "ring" and ring["args"]["bytes"] == 1 << 20
        assert ring["args"]["seq"] == 0
        messages = [
            e for e in spans(events, "send", rank) + spans(events, "recv", rank) if inside(e, ring)
        ]
        assert messages and all(e["args"]["peer"] == 1 - rank for e in messages)
        # every byte of the ring's two phases: (n-1)/n of the buffer each way, per phase
        assert sum(e["args"]["bytes"] for e in messages if e["name"] == "send") == 1 << 20
        assert any(inside(e, ring) for e in spans(events, "reduce", rank))
        # what ran on its completion, after it on its thread
        callbacks = [e for e in spans(events, "callbacks", rank) if e["tid"] == ring["tid"]]
        assert len(callbacks) == 3 and all(e["cat"] == "callback" for e in callbacks)
        assert min(e["ts"] for e in callbacks) >= ring["ts"] + ring["dur"] - 1
        (coalesced,) = spans(events, "all_reduce_coalesced", rank)
        assert any(inside(e, coalesced) for e in spans(events, "pack", rank))
        assert any(inside(e, coalesced) for e in spans(events, "unpack", rank))
        (sparse,) = spans(events, "sparse_all_reduce", rank)
        assert sparse["args"]["algorithm"] == "sparse_gather"
        assert any(inside(e, sparse) for e in spans(events, "encode", rank))
        assert any(inside(e, sparse) for e in spans(events, "decode", rank))
        names = {
            e["tid"]: e["args"]["name"]
            for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == rank
        }
        assert ring["tid"] in names
    # the parts stay beside the merged file
    assert os.path.exists(path + ".rank0.json") and os.path.exists(path + ".rank1.json")


def _untraced(comm):
    comm.all_reduce(torch.ones(1000))
    events, dropped, _ = _C.trace_take()
    return len(events), dropped


def test_nothing_is_recorded_unless_started():
    assert run_ranks(2, _untraced) == [(0, 0), (0, 0)]


def _bounded(comm, path):
    trace.start(path, max_events=3)
    for _ in range(5):
        comm.all_reduce(torch.ones(1000))
    trace.stop()
    with open(path + f".rank{comm.rank}.json") as f:
        data = json.load(f)
    return len(spans(data["traceEvents"], "all_reduce")), data["otherData"][
        "ringcomm_dropped_events"
    ]


def test_a_full_timeline_counts_what_it_dropped(tmp_path):
    results = run_ranks(
        2, _bounded, str(tmp_path / "t.json"), env={"WORLD_SIZE": "2", "MASTER_PORT": "2"}
    )
    for kept, dropped in results:
        assert kept <= 3 and dropped > 0


def _counted(comm):
    n = 1 << 16
    for _ in range(3):
        comm.all_reduce(torch.ones(n), algorithm="ring")
    work = comm.all_reduce(torch.ones(n), algorithm="ring", async_op=True)
    work.wait()
    if comm.rank == 0:
        comm.send(torch.ones(10), 1)
    else:
        comm.recv(torch.empty(10), 0)
    return work.stats(), comm.stats()


def test_stats_count_calls_payload_bytes_and_time():
    n_bytes = 4 << 16
    for rank, (op, total) in enumerate(run_ranks(2, _counted)):
        # a 2-rank ring sends half the buffer in each of its two phases
        assert op["calls"] == 1 and op["bytes_sent"] == op["bytes_received"] == n_bytes
        assert 0 <= op["idle_s"] <= op["run_s"] and op["queued_s"] >= 0
        ar = total["collectives"]["all_reduce"]
        assert ar["calls"] == 4 and ar["bytes_sent"] == ar["bytes_received"] == 4 * n_bytes
        assert 0 <= ar["idle_s"] <= ar["run_s"]
        p2p = total["collectives"]["send/recv"]
        assert p2p["calls"] == 1
        assert (p2p["bytes_sent"], p2p["bytes_received"]) == ((40, 0) if rank == 0 else (0, 40))
        assert sum(total["bytes_sent"].values()) > 4 * n_bytes  # headers too
        assert total["idle_s"] >= ar["idle_s"]


def _through_boards(comm, count):
    sent = {}
    for algorithm in ("ring", "shared_buffer"):
        before = ringcomm.shm_bytes_sent()
        work = comm.all_reduce(torch.ones(count), algorithm=algorithm, async_op=True)
        work.wait()
        sent[algorithm] = (
            work.stats()["bytes_sent"],
            work.stats()["bytes_received"],
            ringcomm.shm_bytes_sent() - before,
        )
    return sent


def test_stats_count_the_payload_read_through_the_boards():
    """The shared_buffer all-reduce moves its payload through the boards, not messages: what
    peers read of a rank's board counts as sent, what it reads of theirs as received, 2(n-1)/n of
    the buffer each way, as the ring's."""
    world, count = 3, 3 << 12
    payload = 2 * (world - 1) * count * 4 // world
    for sent in run_ranks(world, _through_boards, count, env={"RINGCOMM_TRANSPORT": "shm"}):
        for algorithm, (payload_sent, payload_received, shm_sent) in sent.items():
            assert payload_sent == payload_received == payload, (algorithm, sent)
            assert payload <= shm_sent < payload + 4096, (algorithm, sent)  # + messages' headers


DDP_JOB = """
import json, os, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import ringcomm
from ringcomm import hooks, trace

dist.init_process_group("gloo")
torch.manual_seed(0)
# over 1 MB (DDP's first bucket after its rebuild) in buckets of 0.25 MB
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)), bucket_cap_mb=0.25)
state = {state}
model.register_comm_hook(state, hooks.{hook})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 5
with torch.profiler.profile() as prof:
    for _ in range(steps):
        F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
        opt.step(); opt.zero_grad()
stats = hooks.default_communicator().stats()
ranges = sorted({{e.name for e in prof.events() if e.name.startswith("ringcomm:")}})
if dist.get_rank() == 0:  # one line: two ranks' long lines could interleave in torchrun's output
    print(json.dumps({{"buckets": stats["buckets"], "ranges": ranges, "steps": steps,
                      "state_buckets": None if state is None else state.bucket_stats()}}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("hook", ["allreduce_hook", "topk_hook"])
def test_ddp_buckets_on_the_timeline_in_stats_and_in_torch_profiler(tmp_path, monkeypatch, hook):
    path = tmp_path / "ddp.json"
    monkeypatch.setenv("RINGCOMM_TIMELINE", str(path))
    state = (
        "None"
        if hook == "allreduce_hook"
        else "hooks.TopKState(dense_steps=0, warmup_steps=0, adaptive=False, schedule='fixed')"
    )
    script = DDP_JOB.format(hook=hook, state=state)
    out = run_torchrun(tmp_path, script, nproc=2)
    result = json.loads(out.strip().splitlines()[-1])
    buckets = result["buckets"]
    assert len(buckets) >= 2
    # DDP rebuilds its buckets after the first step: indices may cover other parameters then
    assert buckets["0"]["calls"] == result["steps"]
    for b in buckets.values():
        assert b["calls"] >= 1
        assert b["bytes_sent"] > 0 and b["bytes_received"] > 0
        assert b["comm_s"] > 0 and 0 <= b["idle_s"] <= b["run_s"]
    assert any(r.startswith("ringcomm: bucket") for r in result["ranges"])
    if hook == "topk_hook":
        assert "ringcomm: compress" in result["ranges"]
        assert result["state_buckets"] == buckets  # the hook state reports the same
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    for rank in (0, 1):
        bucket_spans = [e for e in spans(events, "bucket", rank)]
        assert {tracks[(rank, e["tid"])] for e in bucket_spans} == {
            f"DDP bucket {i}" for i in buckets
        }
        assert len(bucket_spans) == sum(b["calls"] for b in buckets.values())
        assert all(
            e["args"]["bucket"] == int(tracks[(rank, e["tid"])].split()[-1]) for e in bucket_spans
        )
        if hook == "topk_hook":
            assert spans(events, "compress", rank) and spans(events, "sparse_all_reduce", rank)
        else:
            assert len(spans(events, "all_reduce", rank)) >= len(bucket_spans)


def test_core_log_lines_go_to_the_ringcomm_logger(tmp_path):
    script = tmp_path / "log.py"
    script.write_text(
        "import logging, sys, torch\n"
        "records = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): records.append(record.getMessage())\n"
        "logging.getLogger('ringcomm').addHandler(Keep())\n"
        "logging.getLogger('ringcomm').setLevel(logging.INFO)\n"
        "import ringcomm\n"
        "comm = ringcomm.init()\n"
        "comm.all_reduce(torch.ones(4))\n"
        "comm.close()\n"
        "print(any('transports by peer' in r for r in records))\n"
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(
                os.environ,
                RINGCOMM_DEBUG="INFO",
                RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
        )
        for r in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out.strip() == "True"
        assert "transports by peer" not in err  # the logger had a handler: not on stderr


def test_merge_cuts_the_events_out_of_parts_it_wrote_and_loads_the_others(tmp_path, monkeypatch):
    """Parts in the writer's layout are merged as text (their events never parsed), others
    loaded: the merged events are every part's, in order, whatever their strings hold, and the
    merged file is itself a part that merges again."""
    from ringcomm import trace

    def event(name, rank):
        return {"name": name, "ph": "X", "ts": 1.0, "dur": 2.0, "pid": rank, "tid": 1, "args": {}}

    tricky = ['], "displayTimeUnit": "ms"}', '"traceEvents": [', "\u00e9\n", "é"]
    written = []
    for rank, names in enumerate([tricky, [], ["all_reduce"]]):
        events = [event(name, rank) for name in names]
        part = tmp_path / f"p{rank}.json"
        trace._write_json(
            str(part),
            {
                "otherData": {
                    "ringcomm_rank": rank,
                    "ringcomm_dropped_events": 0,
                    "ringcomm_events": len(events),
                },
                "traceEvents": events,
                "displayTimeUnit": "ms",
            },
        )
        written.append((part, events))
    # the writer's layout without the count: loaded, not cut
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps(
            {
                "otherData": {"ringcomm_rank": 3, "ringcomm_dropped_events": 2},
                "traceEvents": [event("x", 3)],
                "displayTimeUnit": "ms",
            }
        )
    )
    parts = [str(p) for p, _ in written] + [str(other)]
    loads, loaded = json.loads, []
    monkeypatch.setattr(json, "loads", lambda text, **kw: loaded.append(text) or loads(text, **kw))
    out = tmp_path / "merged.json"
    count = trace.merge(parts, str(out))
    assert loaded == [other.read_text()]  # the writer's parts were cut
    merged = loads(out.read_text())
    expected = [e for _, events in written for e in events] + [event("x", 3)]
    assert count == len(expected) == 6 and merged["traceEvents"] == expected
    assert merged["otherData"] == {
        "ringcomm_ranks": [0, 1, 2, 3],
        "ringcomm_dropped_events": 2,
        "ringcomm_events": 6,
    }
    again = tmp_path / "again.json"
    assert trace.merge([str(out), str(written[2][0])], str(again)) == 7
    assert len(loaded) == 1
    assert loads(again.read_text())["traceEvents"] == expected + written[2][1]


def test_timeline_script_merges_parts_and_draws_a_window(tmp_path):
    parts = []
    for rank in (0, 1):
        part = tmp_path / f"p{rank}.json"
        part.write_text(
            json.dumps(
                {
                    "traceEvents": [
                        {
                            "name": "all_reduce",
                            "ph": "X",
                            "ts": 10.0 * rank,
                            "dur": 5.0,
                            "pid": rank,
                            "tid": 1,
                            "args": {},
                        }
                    ],
                    "otherData": {"ringcomm_rank": rank, "ringcomm_dropped_events": rank},
                }
            )
        )
        parts.append(str(part))
    out = tmp_path / "merged.json"
    subprocess.run(
        [sys.executable, TIMELINE, "merge", str(out), *parts],
        check=True,
        timeout=60,
        capture_output=True,
    )
    merged = json.loads(out.read_text())
    assert len(merged["traceEvents"]) == 2
    assert merged["otherData"] == {
        "ringcomm_ranks": [0, 1],
        "ringcomm_dropped_events": 1,
        "ringcomm_events": 2,
    }
    png = tmp_path / "t.png"
    subprocess.run(
        [
            sys.executable,
            TIMELINE,
            "plot",
            str(out),
            str(png),
            "--ranks",
            "1",
            "--from",
            "0",
            "--to",
            "12",
        ],
        check=True,
        timeout=60,
        capture_output=True,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_python_knobs_are_parsed_like_the_cores(monkeypatch, tmp_path):
    from ringcomm import staging

    monkeypatch.setenv("RINGCOMM_TIMELINE_MAX_EVENTS", "lots")
    with pytest.raises(ValueError, match="RINGCOMM_TIMELINE_MAX_EVENTS=lots is not an integer"):
        ringcomm.trace.start(str(tmp_path / "t.json"))
    for value in ("4M", "1_000", "12 ", "0x10"):  # what strtoll, as the core uses it, refuses
        monkeypatch.setenv("RINGCOMM_STAGING_SLICE_BYTES", value)
        with pytest.raises(ValueError, match=f"RINGCOMM_STAGING_SLICE_BYTES={value} is not an"):
            staging.slice_bytes()
    monkeypatch.setenv("RINGCOMM_STAGING_SLICE_BYTES", "")  # empty: the default, as in the core
    assert staging.slice_bytes() == 4 << 20
    monkeypatch.setenv("RINGCOMM_STAGING_SLICE_BYTES", "65536")
    assert staging.slice_bytes() == 65536
