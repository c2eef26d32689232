"""The Communicator: rendezvous through a torch.distributed Store, collectives on tensors."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _C, device, fusion, launch, staging, trace
from .stats import BucketStats
from .compress import TOPK_DTYPES
from ._buffers import (
    ALGORITHMS,
    FLOATING,
    SPARSE_ALGORITHMS,
    TORCH_DTYPES,
    Buffer,
    algorithm_code,
    op_code,
)

RingcommError = _C.RingcommError
CollectiveTimeoutError = _C.CollectiveTimeoutError


def _error_of(core_work) -> Optional[RingcommError]:
    """The failed operation's error, as the class of its kind; None if it succeeded."""
    message = core_work.error()
    return _C.error_types[core_work.error_kind()](message) if message else None


logger = logging.getLogger("ringcomm")
# The device transports a Communicator tries for its CUDA tensors (ringcomm.device), in order;
# where none serves every rank it stages them through host memory itself.
DEVICE_TRANSPORTS = ("cuda_ipc", "nccl")

_instance_counter = itertools.count()
_live = set()  # communicators to close at exit, so progress threads never outlive Python
_live_lock = threading.Lock()


class Work:
    """Handle of an asynchronous operation (``async_op=True``)."""

    def __init__(self, core_work, result, keep=(), on_success=None):
        self._core = core_work
        self._result = result
        self._keep = keep  # every buffer the operation reads or writes stays alive until done
        self._future = None
        self._on_success = on_success
        self._lock = threading.Lock()
        self._finished = threading.Event()  # set once the result is final: on_success has run
        self._observers = []  # _on_finish's functions not run yet
        # The core marks an operation finished before it runs its callbacks, and runs a callback
        # added after that at once on the adding thread; so what must follow on_success (waking
        # waiters, completing the future) hangs off this one callback, not off the core.
        core_work.add_done_callback(self._on_core_done)

    def _on_core_done(self):
        try:
            if self._on_success is not None and not self._core.error():
                self._on_success()
        finally:
            while True:  # observers added meanwhile run too, before anyone is woken
                with self._lock:
                    observers, self._observers = self._observers, []
                    if not observers:
                        self._finished.set()
                        future = self._future
                        break
                for fn in observers:
                    fn()
            if future is not None:
                self._complete(future)

    def _on_finish(self, fn):
        """Runs fn() once the operation is done (succeeded or failed), before wait() returns and
        before the future completes; at once if it is done already. For bookkeeping that must be
        complete when the caller learns of the result (ringcomm.stats)."""
        with self._lock:
            if not self._finished.is_set():
                self._observers.append(fn)
                return
        fn()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until done; raises RingcommError if the operation failed or `timeout` (seconds
        or timedelta) passes first."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if not self._core.wait(-1.0 if timeout is None else float(timeout)):
            raise CollectiveTimeoutError(f"Timed out after {timeout}s waiting for the operation")
        self._finished.wait()  # on_success may still be running on the progress thread
        return True

    def is_completed(self) -> bool:
        return self._finished.is_set()

    def stats(self) -> dict:
        """What the operation cost, once done: payload bytes sent and received, seconds queued
        behind other operations, running, and of that idle (waiting for peers). Zero for sends
        and receives."""
        return self._core.stats()

    def source(self) -> int:
        """The rank a receive took its message from (-1 for other operations, or before a
        receive from any source has one)."""
        return self._core.source()

    def is_success(self) -> bool:
        return self._finished.is_set() and not self._core.error()

    def exception(self) -> Optional[RingcommError]:
        return _error_of(self._core)

    def result(self):
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch.futures.Future completed with the result (the tensor) or the error."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = torch.futures.Future()
            finished = self._finished.is_set()  # else _on_core_done completes it
        if finished:
            self._complete(self._future)
        return self._future

    def _complete(self, future: torch.futures.Future):
        err = _error_of(self._core)
        if err is not None:
            future.set_exception(err)
        else:
            future.set_result(self._result)


def _tensor_path(core):
    """(ringcomm._C_torch.all_reduce_tensor, core's capsule) where the torch backend's module is
    built already (fusion reads tensor lists with it too), else None: a blocking all_reduce of a
    plain CPU tensor then reads it in C++, 0.5 us sooner than Buffer does."""
    module = fusion.torch_module()
    return None if module is None else (module.all_reduce_tensor, core.capsule())


class Communicator:
    """One rank of a group of `world_size` processes that rendezvous through `store`.

    Collectives work in place on contiguous CPU tensors (or numpy arrays). With
    ``async_op=True`` they return a Work; otherwise they return None when done. Operations run in
    issue order on a progress thread (blocking calls run on the caller's thread when nothing is
    queued). Errors raise RingcommError, after which the communicator is broken.

    all_reduce takes CUDA tensors too, on the device path: at the first one on a device, every
    rank joins a ringcomm.device.DeviceCommunicator there over the first of `device_transports`
    that serves every rank; where none does (or `device_transports` is empty), CUDA tensors are
    staged through pinned host memory (ringcomm/staging.py), which is logged at INFO once.
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout: timedelta = timedelta(minutes=10),
        name: Optional[str] = None,
        device_transports: Sequence[str] = DEVICE_TRANSPORTS,
    ):
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        self.rank, self.world_size, self.timeout = int(rank), int(world_size), timeout
        unknown = [t for t in device_transports if t not in DEVICE_TRANSPORTS]
        if unknown:
            raise ValueError(
                f"device_transports must be some of {DEVICE_TRANSPORTS}, got "
                f"{tuple(device_transports)}"
            )
        name = name if name is not None else f"comm{next(_instance_counter)}"
        store = dist.PrefixStore(f"ringcomm/{name}", store)
        self._device_paths = device.DevicePaths(
            store, self.rank, self.world_size, timeout, tuple(device_transports)
        )
        self._core = _C.Communicator(
            self.rank, self.world_size, timeout.total_seconds(), os.environ.get("MASTER_ADDR", "")
        )

        def get(key):
            store.wait([key], timeout)
            return store.get(key).decode()

        self._core.rendezvous(lambda key, value: store.set(key, value), get)
        self._tensor_path = _tensor_path(self._core)
        trace.note_rank(self.rank)
        self.bucket_stats = BucketStats()
        self._closed = False
        with _live_lock:
            _live.add(self)

    @classmethod
    def _borrow(cls, core, timeout: timedelta, paths: device.DevicePaths) -> "Communicator":
        """A Communicator over a core communicator someone else owns (a torch process group's
        ringcomm backend), its CUDA tensors on the owner's device paths: close() leaves both to
        their owner."""
        self = cls.__new__(cls)
        self._core = core
        self._tensor_path = _tensor_path(core)
        self.rank, self.world_size, self.timeout = core.rank, core.world_size, timeout
        self._device_paths = paths
        self.bucket_stats = BucketStats()
        self._closed = True
        return self

    # -- helpers --------------------------------------------------------------------------

    def _finish(self, core_work, result, async_op, keep=(), on_success=None):
        if async_op:
            return Work(core_work, result, keep, on_success)
        if on_success is not None:
            on_success()
        return None

    @staticmethod
    def _check_op(op, buf: Buffer) -> int:
        code = op_code(op)
        if code == 1 and buf.dtype == 8:
            raise TypeError("op avg is undefined on bool")
        if code >= 5 and buf.dtype in FLOATING:
            raise TypeError(
                f"op {('band', 'bor', 'bxor')[code - 5]} needs an integer or bool "
                f"dtype, got {buf.obj.dtype}"
            )
        return code

    def _check_rank(self, r: int, what: str) -> int:
        r = int(r)
        if not 0 <= r < self.world_size:
            raise ValueError(f"{what} {r} out of range for world_size {self.world_size}")
        return r

    @staticmethod
    def _same_dtype(a: Buffer, b: Buffer):
        if a.dtype != b.dtype:
            raise TypeError(f"dtype mismatch: {a.obj.dtype} vs {b.obj.dtype}")

    # -- collectives ----------------------------------------------------------------------

    def all_reduce(self, tensor, op="sum", algorithm: str = "auto", async_op: bool = False):
        """In place. A CUDA tensor runs on the device path with ProcessGroupNCCL's semantics
        (ringcomm.device.DeviceCommunicator.all_reduce_work: after the work on its current
        stream, on a stream of the path's own; the Work's wait() and CUDA-aware future order the
        current stream after it), or where no device transport serves every rank is staged
        through pinned host memory in slices (ringcomm/staging.py); `algorithm` then names one
        of the device path's (ringcomm.device) or the host's. The host's: "auto", a built-in's
        name, or one registered by ringcomm.algorithms."""
        if self._tensor_path is not None and not async_op:
            all_reduce_tensor, core = self._tensor_path
            # A built-in's code, else the name: a registered algorithm's (CPU tensors), or one of
            # the device path's (CUDA tensors, which this path leaves alone)
            if all_reduce_tensor(core, tensor, op_code(op), ALGORITHMS.get(algorithm, algorithm)):
                return None
        try:
            buf = Buffer(tensor)
        except ValueError:  # not a CPU buffer: checked here, off the CPU path's ~2 us
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                path = self._device_paths.get(tensor.device)
                if path is None:
                    return staging.all_reduce(self, tensor, op, algorithm, async_op)
                return path.all_reduce_work(tensor, op, algorithm, async_op)
            raise
        w = self._core_all_reduce(buf, self._check_op(op, buf), algorithm, async_op)
        return Work(w, tensor) if async_op else None

    def _core_all_reduce(self, buf: Buffer, op: int, algorithm: str, async_op: bool):
        """The core's all_reduce of `buf` by a built-in algorithm, or one registered by name
        (ringcomm.algorithms)."""
        code = ALGORITHMS.get(algorithm)
        if code is None:
            return _C.all_reduce_registered(
                self._core, buf.ptr, buf.numel, buf.dtype, op, algorithm, async_op
            )
        return self._core.all_reduce(buf.ptr, buf.numel, buf.dtype, op, code, async_op)

    def _host_all_reduce(self, tensor: torch.Tensor, op, algorithm: str, on_success) -> Work:
        """all_reduce of a CPU tensor with async_op=True, running on_success() (on the progress
        thread) once it succeeds, before its waiters learn it is done."""
        buf = Buffer(tensor)
        w = self._core_all_reduce(buf, self._check_op(op, buf), algorithm, True)
        return Work(w, tensor, on_success=on_success)

    def reduce_scatter(
        self, output, input, op="sum", async_op: bool = False, algorithm: str = "ring"
    ):
        """Reduces `input` (world_size blocks of output.numel() elements, as one tensor or a list
        of world_size tensors) over all ranks; block `rank` of the result lands in `output`.
        `algorithm`: "ring", or one registered by ringcomm.algorithms."""
        out = Buffer(output, "output")
        flat = (
            torch.cat([t.reshape(-1) for t in input]) if isinstance(input, (list, tuple)) else input
        )
        inp = Buffer(flat, "input")
        self._same_dtype(out, inp)
        if inp.numel != out.numel * self.world_size:
            raise ValueError(
                f"reduce_scatter input has {inp.numel} elements, expected "
                f"world_size * output.numel() = {out.numel * self.world_size}"
            )
        code = self._check_op(op, out)
        if algorithm == "ring":
            w = self._core.reduce_scatter(out.ptr, inp.ptr, out.numel, out.dtype, code, async_op)
        else:
            w = _C.reduce_scatter_registered(
                self._core, out.ptr, inp.ptr, out.numel, out.dtype, code, algorithm, async_op
            )
        return self._finish(w, output, async_op, keep=(flat,))

    def all_gather(self, output, input, async_op: bool = False, algorithm: str = "ring"):
        """Gathers every rank's `input` into `output`: one tensor of world_size * input.numel()
        elements, or a list of world_size tensors shaped like input. `algorithm`: "ring", or one
        registered by ringcomm.algorithms."""
        n = Buffer(input, "input").numel
        return self._all_gather(output, input, [n] * self.world_size, async_op, algorithm)

    def all_gatherv(self, output, input, counts: Sequence[int], async_op: bool = False):
        """Like all_gather with per-rank sizes: rank r contributes counts[r] elements."""
        return self._all_gather(output, input, counts, async_op, "ring")

    def _all_gather(self, output, input, counts: Sequence[int], async_op: bool, algorithm: str):
        inp = Buffer(input, "input")
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size or min(counts) < 0:
            raise ValueError(f"counts must be {self.world_size} non-negative sizes, got {counts}")
        if counts[self.rank] != inp.numel:
            raise ValueError(
                f"counts[{self.rank}] = {counts[self.rank]} but input has {inp.numel} elements"
            )
        as_list = isinstance(output, (list, tuple))
        if as_list:
            if len(output) != self.world_size:
                raise ValueError(f"output list needs {self.world_size} tensors, got {len(output)}")
            for r, t in enumerate(output):
                if t.numel() != counts[r]:
                    raise ValueError(f"output[{r}] has {t.numel()} elements, expected {counts[r]}")
            flat = torch.empty(sum(counts), dtype=input.dtype)
        else:
            flat = output
        out = Buffer(flat, "output")
        self._same_dtype(out, inp)
        if out.numel != sum(counts):
            raise ValueError(f"output has {out.numel} elements, expected {sum(counts)}")

        def scatter_to_list():
            for t, piece in zip(output, torch.split(flat, counts)):
                t.copy_(piece.view_as(t))

        if algorithm == "ring":
            w = self._core.all_gatherv(out.ptr, inp.ptr, counts, out.dtype, async_op)
        else:  # all_gather: every count the same
            w = _C.all_gather_registered(
                self._core, out.ptr, inp.ptr, inp.numel, out.dtype, algorithm, async_op
            )
        return self._finish(
            w, output, async_op, keep=(flat, input), on_success=scatter_to_list if as_list else None
        )

    def sparse_all_reduce(
        self,
        indices,
        values,
        numel: int,
        out=None,
        op="sum",
        algorithm: str = "auto",
        async_op: bool = False,
    ):
        """Dense sum (op="avg": average) over ranks of every rank's (indices, values) pairs.

        indices: int32 tensor of k positions in [0, numel) (repeats add up on CPU tensors; CUDA
        ones must be distinct within a rank, as a top-k's are); values: k float32,
        float16 or bfloat16 values; ranks may pass different k. The result goes to `out` (numel
        elements, float32/float16/bfloat16; default a new float32 tensor), which is returned.
        algorithm: "auto" (cheapest estimate), "sparse_gather", "sparse_ranges" or "ring" (dense).
        CUDA indices and values (`out` then a CUDA tensor too) go on the device path: the counts
        of pairs agreed through the host, the pairs gathered over the device transport and
        scatter-added in rank order there (DeviceCommunicator.sparse_all_reduce_work, whatever
        `algorithm` says); where there is none, they are staged through the host
        (ringcomm/staging.py).
        """
        if isinstance(values, torch.Tensor) and values.is_cuda:
            path = self._device_paths.get(values.device)
            if path is None:
                return staging.sparse_all_reduce(
                    self, indices, values, numel, out, op, algorithm, async_op
                )
            out = (
                torch.empty(int(numel), dtype=torch.float32, device=values.device)
                if out is None
                else out
            )
            if out.numel() != int(numel):
                raise ValueError(f"out has {out.numel()} elements, expected numel = {numel}")
            # The counts, and whether any rank has seen a bad index so far: every rank raises
            # at the same call, or none does.
            said = torch.zeros(2 * self.world_size, dtype=torch.int64)
            mine = [indices.numel(), int(path.bad_index_seen())]
            self.all_gather(said, torch.tensor(mine, dtype=torch.int64))
            if said[1::2].any():
                path.raise_bad_index()
            counts = said[0::2].tolist()
            work = path.sparse_all_reduce_work(indices, values, counts, out, op, async_op)
            return work if async_op else out
        return self._host_sparse_all_reduce(
            indices, values, numel, out, op, algorithm, None, async_op
        )

    def _host_sparse_all_reduce(
        self,
        indices,
        values,
        numel: int,
        out,
        op,
        algorithm: str,
        on_success,
        async_op: bool = True,
    ):
        """sparse_all_reduce of CPU tensors: a Work (running on_success() once it succeeds) with
        async_op, else the result."""
        idx, val = Buffer(indices, "indices"), Buffer(values, "values")
        if idx.dtype != TORCH_DTYPES[torch.int32]:
            raise TypeError(f"indices must be int32, got {idx.obj.dtype}")
        if idx.numel != val.numel:
            raise ValueError(f"{idx.numel} indices but {val.numel} values")
        numel = int(numel)
        out = torch.empty(numel, dtype=torch.float32) if out is None else out
        res = Buffer(out, "out")
        if res.numel != numel:
            raise ValueError(f"out has {res.numel} elements, expected numel = {numel}")
        code = op_code(op)
        w = self._core.sparse_all_reduce(
            idx.ptr,
            val.ptr,
            idx.numel,
            val.dtype,
            res.ptr,
            numel,
            res.dtype,
            code,
            algorithm_code(algorithm, SPARSE_ALGORITHMS),
            async_op,
        )
        if async_op:
            return Work(w, out, keep=(indices, values), on_success=on_success)
        return out

    def compression_costs(
        self, numel: int, k: int, value_dtype=torch.float32, out_dtype=torch.float32
    ) -> tuple:
        """Estimated (sparse, dense) costs of averaging a vector of `numel` elements over the
        ranks, as its top k (index, value) pairs through sparse_all_reduce or whole through
        all_reduce, in seconds by the link model (link_model(); docs/algorithms.md). The same on
        every rank for the same arguments."""
        for name, dtype in (("value_dtype", value_dtype), ("out_dtype", out_dtype)):
            if dtype not in TOPK_DTYPES:
                raise TypeError(f"{name} must be float32, float16 or bfloat16, got {dtype}")
        return self._core.compression_costs(
            int(numel), int(k), TORCH_DTYPES[value_dtype], TORCH_DTYPES[out_dtype]
        )

    def link_model(self) -> dict:
        """The cost model's figures every rank agreed on when connecting (probed, or from
        RINGCOMM_TUNING): alpha_s (seconds per round of messages), bytes_per_s (one link's payload
        rate), reduce_bytes_per_s (one rank's float32 sum rate), the same two for the links inside
        a host, single_copy, and factors ({bytes: {algorithm: measured / estimated time}}, where
        3 or more ranks share one host, else empty); the slowest rank's."""
        return self._core.link_model()

    @property
    def hosts(self) -> list:
        """Ranks grouped by host (lists of ranks, each host's ascending, hosts by their lowest
        rank). With more than one host and the same number (more than one) of ranks on each,
        algorithm "auto" takes the hierarchical all-reduce where it would take the ring."""
        return self._core.hosts

    @property
    def transports(self) -> list:
        """The transport carrying data to each rank, by rank: "shm", "tcp" ("self" for this one)."""
        return [self._core.transport_of(r) for r in range(self.world_size)]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has written to its connections so far (message headers included)."""
        return self._core.bytes_sent

    @property
    def scratch_bytes(self) -> int:
        """Scratch memory the algorithms hold between calls; buffers more than twice what the last
        64 operations needed are given back."""
        return self._core.scratch_bytes

    def bytes_sent_by_transport(self) -> dict:
        """bytes_sent split by transport: {"tcp": ..., "shm": ...}."""
        return {name: self._core.bytes_sent_over(name) for name in ("tcp", "shm")}

    def stats(self) -> dict:
        """Everything this communicator did so far:

        "collectives": by name ("all_reduce", "send/recv", ...), calls, payload bytes sent and
        received, and seconds queued, running and (of running) idle, waiting for peers;
        "buckets": the same by DDP bucket index for the ringcomm hooks (ringcomm.stats), with
        "comm_s" the time from the hook's call to the bucket's average being ready;
        "bytes_sent": bytes written per transport, message headers included;
        "idle_s": the time all waits spent idle, sends and receives included;
        "cpu_moves": times this rank moved off a CPU the scheduler had put a local peer on too
        (RINGCOMM_SHM_UNSTACK);
        "device": the transport carrying CUDA tensors by device ("cuda:0": "cuda_ipc", "nccl",
        or "host" where they are staged; ringcomm.staging.bytes_to_host() counts what staging
        copied to the host), for each device an all_reduce has met so far.
        """
        return {
            "collectives": self._core.stats(),
            "buckets": self.bucket_stats.as_dict(),
            "bytes_sent": self.bytes_sent_by_transport(),
            "idle_s": self._core.idle_s,
            "cpu_moves": self._core.cpu_moves,
            "device": self._device_paths.transports(),
        }

    def broadcast(self, tensor, src: int, async_op: bool = False, algorithm: str = "auto"):
        """`algorithm`: "auto" (a binomial tree or a chain, by size), or one registered by
        ringcomm.algorithms."""
        buf = Buffer(tensor)
        src = self._check_rank(src, "src")
        if algorithm == "auto":
            w = self._core.broadcast(buf.ptr, buf.numel, buf.dtype, src, async_op)
        else:
            w = _C.broadcast_registered(
                self._core, buf.ptr, buf.numel, buf.dtype, src, algorithm, async_op
            )
        return self._finish(w, tensor, async_op)

    def reduce(self, tensor, dst: int, op="sum", async_op: bool = False, algorithm: str = "auto"):
        """Reduces into `tensor` on rank `dst`; other ranks' tensors are left unchanged.
        `algorithm`: "auto" (a binomial tree or a chain, by size), or one registered by
        ringcomm.algorithms."""
        buf = Buffer(tensor)
        code = self._check_op(op, buf)
        dst = self._check_rank(dst, "dst")
        if algorithm == "auto":
            w = self._core.reduce(buf.ptr, buf.numel, buf.dtype, code, dst, async_op)
        else:
            w = _C.reduce_registered(
                self._core, buf.ptr, buf.numel, buf.dtype, code, dst, algorithm, async_op
            )
        return self._finish(w, tensor, async_op)

    def barrier(self, async_op: bool = False):
        return self._finish(self._core.barrier(async_op), None, async_op)

    def gather(self, input, outputs, dst: int, async_op: bool = False):
        """Every rank's `input` lands in outputs[rank] on rank `dst` (a list of world_size tensors
        like input there; ignored elsewhere)."""
        inp = Buffer(input, "input")
        dst = self._check_rank(dst, "dst")
        bufs = self._blocks(outputs, inp, "outputs") if self.rank == dst else []
        w = self._core.gather(inp.ptr, [b.ptr for b in bufs], inp.numel, inp.dtype, dst, async_op)
        return self._finish(w, outputs, async_op, keep=(input, outputs))

    def scatter(self, inputs, output, src: int, async_op: bool = False):
        """inputs[q] on rank `src` (world_size tensors like output; ignored elsewhere) lands in
        rank q's `output`."""
        out = Buffer(output, "output")
        src = self._check_rank(src, "src")
        bufs = self._blocks(inputs, out, "inputs") if self.rank == src else []
        w = self._core.scatter([b.ptr for b in bufs], out.ptr, out.numel, out.dtype, src, async_op)
        return self._finish(w, output, async_op, keep=(inputs, output))

    def all_to_all(self, outputs, inputs, async_op: bool = False):
        """inputs[q] goes to rank q, where it lands in outputs[rank]: world_size tensors of one
        dtype on each side, of any sizes as long as each pair agrees."""
        ins = [Buffer(t, f"inputs[{q}]") for q, t in enumerate(self._per_rank(inputs, "inputs"))]
        outs = [
            Buffer(t, f"outputs[{q}]") for q, t in enumerate(self._per_rank(outputs, "outputs"))
        ]
        for b in ins[1:] + outs:
            self._same_dtype(ins[0], b)
        w = self._core.all_to_all(
            [b.ptr for b in ins],
            [b.numel for b in ins],
            [b.ptr for b in outs],
            [b.numel for b in outs],
            ins[0].dtype,
            async_op,
        )
        return self._finish(w, outputs, async_op, keep=(inputs, outputs))

    def _per_rank(self, tensors, what):
        if not isinstance(tensors, (list, tuple)) or len(tensors) != self.world_size:
            raise ValueError(f"{what} must be a list of {self.world_size} tensors (one per rank)")
        return tensors

    def _blocks(self, tensors, like: Buffer, what):
        bufs = [Buffer(t, f"{what}[{q}]") for q, t in enumerate(self._per_rank(tensors, what))]
        for q, b in enumerate(bufs):
            self._same_dtype(like, b)
            if b.numel != like.numel:
                raise ValueError(f"{what}[{q}] has {b.numel} elements, expected {like.numel}")
        return bufs

    def send(self, tensor, dst: int, async_op: bool = False):
        buf = Buffer(tensor)
        w = self._core.send(buf.ptr, buf.numel, buf.dtype, self._check_peer(dst, "dst"), async_op)
        return self._finish(w, tensor, async_op)

    def recv(self, tensor, src: int, async_op: bool = False):
        buf = Buffer(tensor)
        w = self._core.recv(buf.ptr, buf.numel, buf.dtype, self._check_peer(src, "src"), async_op)
        return self._finish(w, tensor, async_op)

    def recv_any(self, tensor, async_op: bool = False):
        """Receives the next message from whichever rank's arrives first; returns that rank
        (async_op=True: a Work, whose source() says it once done). Each peer's messages still
        come in the order it sent them."""
        buf = Buffer(tensor)
        w = self._core.recv_any(buf.ptr, buf.numel, buf.dtype, async_op)
        if async_op:
            return Work(w, tensor, keep=(tensor,))
        return w.source()

    def isend(self, tensor, dst: int) -> Work:
        return self.send(tensor, dst, async_op=True)

    def irecv(self, tensor, src: int) -> Work:
        return self.recv(tensor, src, async_op=True)

    # -- coalesced collectives (fusion.py): grouped by dtype, fused into buckets, pipelined --

    def all_reduce_coalesced(
        self,
        tensors,
        op="sum",
        bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES,
        async_op: bool = False,
    ):
        """all_reduce of every tensor in the list, in place, as a few fused operations (buckets of
        at most `bucket_bytes`). Each result is bitwise what `all_reduce(t, op)` gives."""
        return fusion.all_reduce_coalesced(self, tensors, op, bucket_bytes, async_op)

    def broadcast_coalesced(
        self,
        tensors,
        src: int,
        bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES,
        async_op: bool = False,
    ):
        """broadcast of every tensor in the list from rank `src`, fused into buckets."""
        return fusion.broadcast_coalesced(self, tensors, src, bucket_bytes, async_op)

    def all_gather_coalesced(
        self,
        output_lists,
        input_tensors,
        bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES,
        async_op: bool = False,
    ):
        """all_gather of every tensor in `input_tensors`, fused into buckets:
        output_lists[r][i] (world_size lists, tensors like the inputs) receives rank r's
        input_tensors[i]."""
        return fusion.all_gather_coalesced(
            self, output_lists, input_tensors, bucket_bytes, async_op
        )

    def _check_peer(self, peer, what):
        peer = self._check_rank(peer, what)
        if peer == self.rank:
            raise ValueError(f"{what} {peer} is this rank; send/recv with self is not supported")
        return peer

    # -- state ----------------------------------------------------------------------------

    def algorithm_for(self, nbytes: int, algorithm: str = "auto") -> str:
        """The all_reduce algorithm a message of `nbytes` bytes runs now (where auto times its
        calls, what its trials and spans chose)."""
        return self._core.algorithm_for(int(nbytes), algorithm_code(algorithm))

    def auto_trials(self) -> list[dict]:
        """What auto's trials found (RINGCOMM_RETUNE_CALLS), one dict per size class timed so
        far: `bytes` (the class: bytes .. 2 x bytes - 1), `candidates`, `seconds` (each one's
        median in the last agreed trials, NaN before the first), `paid` (each one's mean
        seconds a call over its last span of calls since those trials, NaN where it ran none),
        `winner`, `rounds` (trials agreed), `reference` (the winner's median seconds in its first
        span since trials or a switch, NaN before) and `spans` (spans of calls watched)."""
        return self._core.auto_trials()

    @property
    def broken(self) -> Optional[str]:
        """Why this communicator is broken, or None."""
        return self._core.broken_reason() or None

    def abort(self, reason: str = "aborted"):
        """Fails the running and every queued operation at once with "aborted: <reason>" and
        tells the peers, whose operations with this rank fail with the reason too; the
        communicator is broken after (close() then waits for nothing). From any thread, a
        signal handler or a completion callback; it returns once the peers are told, except from
        the callback of a send or receive, which runs inside the transport: the progress thread
        tells them as soon as that callback returns. The device paths are aborted too."""
        self._device_paths.abort()
        self._core.abort(str(reason))

    def close(self):
        """Finishes queued operations and closes connections. Idempotent; a second caller waits
        for the first. From a completion callback it only stops the progress thread (which cannot
        join itself); the connections close at the next close() from another thread, at exit at
        the latest."""
        if getattr(self, "_closed", True):
            return
        if self._core.on_progress_thread():
            self._core.close()
            return
        self._closed = True
        with _live_lock:
            _live.discard(self)
        with contextlib.ExitStack() as closing:  # each runs, the last first, whatever raises
            closing.callback(self._core.close)
            closing.callback(self._device_paths.close)  # each waits for its stream's work

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"ringcomm.Communicator(rank={self.rank}, world_size={self.world_size})"


def init(
    store=None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout: timedelta = timedelta(minutes=10),
    name: Optional[str] = None,
) -> Communicator:
    """Creates a Communicator.

    Without arguments: reuses torch.distributed's default store (under a prefix) when a process
    group is initialised, else finds its rank, world size and the ranks' meeting point from the
    launcher that started it (torchrun, srun, mpirun, mpiexec: ringcomm.launch.discover) and
    exports them as the env:// variables. `name` is passed on to Communicator.
    """
    if store is None and dist.is_available() and dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if store is None or rank is None or world_size is None:
        found = launch.discover(rank, world_size)
        found.export()
        rank, world_size = found.rank, found.world_size
        if store is None:
            store = found.tcp_store(timeout)
    return Communicator(store, rank, world_size, timeout, name)


def shm_bytes_sent() -> int:
    """Bytes this process has sent through shared memory so far, through every communicator (the
    torch backend's and closed ones included; the kernel's socket counters do not see them):
    written to a peer's slots, read by the peer out of this process's memory (single copy), or
    put on this process's board for peers to read (the shared_buffer all-reduce: once per
    reader)."""
    return _C.shm_bytes_sent()


def shm_bytes_read() -> int:
    """Bytes this process has read out of its peers' memory by single copy so far
    (RINGCOMM_SHM_SINGLE_COPY_BYTES), through every communicator."""
    return _C.shm_bytes_read()


def _close_all():
    with _live_lock:
        live = list(_live)
    for comm in live:
        comm.close()


def _forget_after_fork():
    """In a forked child (a DataLoader worker, say): the communicators are the parent's. The
    child's calls raise (the core checks), and neither close() nor exit touches the parent's
    connections. The lock is made anew: another thread may have held it at the fork."""
    global _live_lock
    _live_lock = threading.Lock()
    for comm in _live:
        comm._closed = True
    _live.clear()


import atexit  # noqa: E402

atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_after_fork)
