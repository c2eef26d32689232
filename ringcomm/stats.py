"""Per-bucket statistics of the DDP hooks (Communicator.stats()["buckets"]).

A hook tells its communicator's BucketStats when it was called for a bucket (`watch`, with the
future it returns) and which operations carry the bucket (`add_work`): each bucket then reports
how often it ran, how often of those a compressing hook sent it whole ("dense", with the reason
in the hook state's statistics), the payload bytes its operations sent and received, the time
from the hook's call to its average being ready ("comm_s"), and of the operations' running time
("run_s") the part spent idle, waiting for peers ("idle_s"). The same span goes to the timeline
(ringcomm.trace) as "DDP bucket <i>".
"""

from __future__ import annotations

import threading
import time

from . import trace

_FIELDS = ("calls", "dense", "bytes_sent", "bytes_received", "comm_s", "run_s", "idle_s")


class BucketStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._buckets: dict = {}

    def _entry(self, index: int) -> dict:
        entry = self._buckets.get(index)
        if entry is None:
            entry = self._buckets[index] = dict.fromkeys(_FIELDS, 0)
        return entry

    def watch(self, index: int, called_ns: int, future):
        """Counts bucket `index` as called at `called_ns` (time.monotonic_ns()) and ready when
        `future` completes; returns the future to hand to DDP (with a torch.profiler range when
        the profiler runs)."""
        with self._lock:
            entry = self._entry(index)
            entry["calls"] += 1

        def ready(fut):
            now = time.monotonic_ns()
            with self._lock:
                entry = self._entry(index)
                entry["comm_s"] += (now - called_ns) * 1e-9
            trace.record("bucket", "bucket", called_ns, now, f"DDP bucket {index}", bucket=index)
            return fut.value()  # raises the bucket's error, which the chained future then holds

        # Chained, not a callback: DDP is woken only once the bucket is counted.
        return trace.profile_future(f"bucket {index}", future.then(ready))

    def count_dense(self, index: int) -> None:
        """Counts a call of bucket `index` that a compressing hook sent whole."""
        with self._lock:
            self._entry(index)["dense"] += 1

    def add_work(self, index: int, work) -> None:
        """Adds what the operation behind `work` (a ringcomm Work) sent, received and spent, once
        it is done and before its waiters learn so."""

        def done():
            if work.exception() is not None:
                return
            s = work.stats()
            with self._lock:
                entry = self._entry(index)
                entry["bytes_sent"] += s["bytes_sent"]
                entry["bytes_received"] += s["bytes_received"]
                entry["run_s"] += s["run_s"]
                entry["idle_s"] += s["idle_s"]

        work._on_finish(done)

    def as_dict(self) -> dict:
        with self._lock:
            return {index: dict(e) for index, e in sorted(self._buckets.items())}
