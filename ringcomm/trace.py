"""The timeline: every collective with its phases, and DDP's buckets, as Chrome trace JSON.

    RINGCOMM_TIMELINE=/tmp/run.json torchrun --nproc-per-node 2 train.py
    # or, in the program:
    ringcomm.trace.start("/tmp/run.json"); ...; ringcomm.trace.stop()

Open the file in https://ui.perfetto.dev or chrome://tracing, or draw it:
`python bench/timeline.py plot /tmp/run.json run.png`.

Each rank is a process (pid = rank) with its threads as tracks: the thread that ran a collective
shows it as a span (name = the collective, args: algorithm, sequence number, bytes), "queued"
before it when it waited behind others, "callbacks" after it (what ran on its completion: the
Work's callbacks and futures, e.g. a DDP hook's chained callbacks), and inside it its phases: each message ("send"/"recv" to
or from a peer, from posted to done as that thread saw it, so a receive includes waiting for the
peer), "reduce", "pack"/"unpack" (coalesced), "encode"/"decode" (sparse), "compress" (top-k
selection in the hook). Each DDP bucket has a track of its own, "DDP bucket <i>": a span from
the hook's call to its average being ready. When torch.profiler runs too, the buckets and
compressions also appear there as record_function ranges ("ringcomm: ...").

stop() writes this process's events to PATH.rank<R>.json; the last rank of the job to do so
(WORLD_SIZE parts with the same job key) merges them into PATH. `python -m ringcomm.trace merge
PATH PART...` merges by hand. Timestamps are wall-clock microseconds (each rank converts its
monotonic clock with its own wall clock: across hosts the alignment is as good as their clock
synchronisation). RINGCOMM_TIMELINE_MAX_EVENTS bounds the events kept per process (default 1M;
the count of dropped events is written out).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import json
import os
import sys
import threading
import time
from typing import Optional

from . import _C
from ._env import env_int, env_string

# C++ span names by category (docs: the list above).
_CATEGORIES = {
    "send": "message",
    "recv": "message",
    "queued": "queue",
    "reduce": "compute",
    "pack": "compute",
    "unpack": "compute",
    "encode": "compute",
    "decode": "compute",
    "callbacks": "callback",
}
# Tracks that are not threads (DDP buckets) get thread ids from here up.
_TRACK_BASE = 1 << 30

_lock = threading.Lock()
_path: Optional[str] = None
_python_events: list = []  # (name, category, begin_ns, end_ns, track, args)
on = False  # read by the hooks before they record anything
_first_rank: Optional[int] = None


def start(path: str, max_events: Optional[int] = None) -> None:
    """Starts recording (dropping anything recorded before); stop() writes to `path`."""
    global _path, on
    if max_events is None:
        max_events = env_int("RINGCOMM_TIMELINE_MAX_EVENTS")
    if max_events < 1:
        raise ValueError(f"max_events must be positive, got {max_events}")
    with _lock:
        _path = os.path.abspath(path)
        _python_events.clear()
        _C.trace_enable(True, int(max_events))
        on = True


def stop() -> Optional[str]:
    """Stops recording and writes this rank's part; returns the merged file's path if this rank
    completed the job's set of parts, else the part's path (None if not recording, or if nothing
    was recorded: then no part is written)."""
    global _path, on
    with _lock:
        if _path is None:
            return None
        path, _path = _path, None
        on = False
        _C.trace_enable(False, 0)
        events, dropped, threads = _C.trace_take()
        python_events = list(_python_events)
        _python_events.clear()
    if not events and not python_events:
        return None  # a process that took part in nothing (a launcher, say) writes no part
    rank = _rank()
    part = _part_path(path, rank)
    trace = _chrome_trace(rank, events, dropped, dict(threads), python_events)
    _write_json(part, trace)
    return _merge_if_complete(path) or part


def record(name: str, category: str, begin_ns: int, end_ns: int, track, **args) -> None:
    """A span recorded from Python (time.monotonic_ns() times) on `track`: a thread id, or the
    name of a track of its own (e.g. "DDP bucket 0")."""
    if not on:
        return
    with _lock:
        _python_events.append((name, category, begin_ns, end_ns, track, args))


@contextlib.contextmanager
def span(name: str, category: str = "compute", **args):
    """Records the block as a span on this thread (and as a torch.profiler range while the
    profiler runs)."""
    profiling = _profiling()
    if not on and not profiling:
        yield
        return
    begin = time.monotonic_ns()
    ranges = _profiler_range(name) if profiling else contextlib.nullcontext()
    with ranges:
        yield
    record(name, category, begin, time.monotonic_ns(), threading.get_native_id(), **args)


def _profiling() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.autograd.profiler._is_profiler_enabled


def _profiler_range(name: str):
    import torch

    return torch.autograd.profiler.record_function(f"ringcomm: {name}")


def profile_future(name: str, future):
    """While torch.profiler runs: a range named `name` from now until `future` completes (how
    torch's own process groups show their collectives); returns the future DDP must get. Else
    `future` itself."""
    if not _profiling():
        return future
    rf = _profiler_range(name)
    rf.__enter__()
    return rf._call_end_callbacks_on_future(future)


def note_rank(rank: int) -> None:
    """Called by every Communicator made: without RANK in the environment, the first one's rank
    names this process in the timeline."""
    global _first_rank
    if _first_rank is None:
        _first_rank = rank


def _rank() -> int:
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return _first_rank if _first_rank is not None else os.getpid()


def _job_key() -> str:
    """What the parts of one job share: the rendezvous they met at."""
    return ":".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    )


def _part_path(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.json"


def _chrome_trace(rank: int, events, dropped: int, threads: dict, python_events) -> dict:
    # Wall-clock microseconds: ranks on other hosts have other monotonic clocks.
    offset_ns = time.time_ns() - time.monotonic_ns()
    pid = os.getpid()
    out = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": rank,
            "tid": 0,
            "args": {"name": f"rank {rank} (pid {pid})"},
        },
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": rank,
            "tid": 0,
            "args": {"sort_index": rank},
        },
    ]
    for name, algorithm, begin, end, thread, peer, seq, nbytes, comm in events:
        args = {"bytes": nbytes}
        if peer >= 0:
            args["peer"] = peer
        if seq >= 0:
            args["seq"] = seq
        if algorithm:
            args["algorithm"] = algorithm
        if comm:
            args["communicator"] = comm
        out.append(
            {
                "name": name,
                "cat": _CATEGORIES.get(name, "collective"),
                "ph": "X",
                "ts": (begin + offset_ns) / 1e3,
                "dur": (end - begin) / 1e3,
                "pid": rank,
                "tid": thread,
                "args": args,
            }
        )
    tracks = {}
    for name, category, begin, end, track, args in python_events:
        if isinstance(track, str):
            track = tracks.setdefault(track, _TRACK_BASE + len(tracks))
        out.append(
            {
                "name": name,
                "cat": category,
                "ph": "X",
                "ts": (begin + offset_ns) / 1e3,
                "dur": (end - begin) / 1e3,
                "pid": rank,
                "tid": track,
                "args": args,
            }
        )
    names = dict(threads)
    if threading.main_thread().native_id is not None:
        names.setdefault(threading.main_thread().native_id, "python main")
    names.update({tid: label for label, tid in tracks.items()})
    seen = {e["tid"] for e in out if e["ph"] == "X"}
    for tid in sorted(seen):
        out.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": rank,
                "tid": tid,
                "args": {"name": names.get(tid, f"thread {tid}")},
            }
        )
        out.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    other = {
        "ringcomm_rank": rank,
        "ringcomm_job": _job_key(),
        "ringcomm_dropped_events": dropped,
        "ringcomm_events": len(out),
    }
    return {"otherData": other, "traceEvents": out, "displayTimeUnit": "ms"}


# The layout _write_json gives a trace (dict order: otherData, traceEvents, displayTimeUnit).
# otherData first: every rank's stop() reads the job key of each part there (_job_of), and
# merge() cuts the events out of the text between the other two.
_HEAD = '{"otherData": '
_EVENTS = ', "traceEvents": ['
_TAIL = '], "displayTimeUnit": "ms"}'


def _write_json(path: str, data: dict) -> None:
    # dumps, not dump: json.dump streams through the pure-Python encoder, 29.6 s for two files
    # of 164k events (24 and 73 MB) where the C one takes a tenth of that
    _write_text(path, json.dumps(data))


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_part(part: str) -> tuple:
    """A part's otherData, its events as JSON text (the array's inside) and how many. A part laid
    out as _write_json writes one is cut, not parsed: loading a part of 164k events and writing
    it out again took seconds a part. Any other is loaded whole."""
    with open(part) as f:
        text = f.read()
    if text.startswith(_HEAD) and text.endswith(_TAIL):
        with contextlib.suppress(ValueError):
            other, end = json.JSONDecoder().raw_decode(text, len(_HEAD))
            if text.startswith(_EVENTS, end) and isinstance(other.get("ringcomm_events"), int):
                return other, text[end + len(_EVENTS) : -len(_TAIL)], other["ringcomm_events"]
    data = json.loads(text)
    events = data["traceEvents"]
    return data.get("otherData", {}), json.dumps(events)[1:-1], len(events)


def merge(parts: list, out: str) -> int:
    """Merges per-rank traces into one file, laid out as a part is; returns its event count."""
    texts, count, dropped, ranks = [], 0, 0, []
    for part in parts:
        other, events, n = _read_part(part)
        if n:
            texts.append(events)
        count += n
        dropped += other.get("ringcomm_dropped_events", 0)
        ranks.append(other.get("ringcomm_rank"))
    other = {
        "ringcomm_ranks": sorted(r for r in ranks if r is not None),
        "ringcomm_dropped_events": dropped,
        "ringcomm_events": count,
    }
    _write_text(out, _HEAD + json.dumps(other) + _EVENTS + ",".join(texts) + _TAIL)
    return count


def _job_of(part: str) -> Optional[str]:
    """The job key a part was written with: read off its head, where _chrome_trace puts it (a
    part of 164k events, 24 MB, took seconds to load whole, and every rank's stop() reads every
    part written so far); a part laid out otherwise is loaded whole."""
    with open(part) as f:
        head = f.read(4096)
        if head.startswith(_HEAD):
            with contextlib.suppress(ValueError):
                other, _ = json.JSONDecoder().raw_decode(head, len(_HEAD))
                return other.get("ringcomm_job")
        f.seek(0)
        return json.load(f).get("otherData", {}).get("ringcomm_job")


def _merge_if_complete(path: str) -> Optional[str]:
    """Merges the job's parts into `path` if all WORLD_SIZE of them are written (under a lock, so
    exactly the last rank to finish does it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    job = _job_key()
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        parts = []
        for part in glob.glob(f"{glob.escape(path)}.rank*.json"):
            try:
                if _job_of(part) == job:
                    parts.append(part)
            except (OSError, ValueError):
                continue  # another job's part being written
        if len(parts) < world:
            return None
        merge(sorted(parts), path)
    with contextlib.suppress(OSError):
        os.unlink(f"{path}.lock")
    return path


if env_string("RINGCOMM_TIMELINE"):
    start(env_string("RINGCOMM_TIMELINE"))
    atexit.register(stop)
