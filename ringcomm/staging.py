"""CUDA tensors through ringcomm's host transports (TCP, shared memory), where no device
transport serves every rank (ringcomm.device), and the pairs of sparse_all_reduce: staged through
pinned host memory in slices, so that the device-to-host copy of one slice overlaps the wire time
of the ones before it, and the copy back of each slice starts as soon as its all-reduce is done.

    all_reduce(comm, cuda_tensor, op, algorithm, async_op)   # what Communicator.all_reduce calls
    bytes_to_host()         # what staging has copied to the host so far, in this process

Stream semantics are torch's: the copies out wait for the work already enqueued on the tensor's
current stream; the result is there for work enqueued on the current stream after the call
(async_op=False), after Work.wait(), or after the Work's future (a CUDA-aware torch Future) is
waited on or chained. The host is blocked only until the last slice is on its way.

A CUDA tensor of S bytes is all-reduced as ceil(S / RINGCOMM_STAGING_SLICE_BYTES) operations,
one per slice: every rank must pass its tensor on the same kind of device (a mismatch is reported
by the signature check, as any other).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from . import _extension
from ._env import env_int

_streams = {}  # device index -> (device-to-host stream, host-to-device stream)
_streams_lock = threading.Lock()
_pending = {}  # (device index, data_ptr) -> the StagedWork still copying back into it
_pending_lock = threading.Lock()
_to_host = 0  # bytes_to_host()
_to_host_lock = threading.Lock()


def bytes_to_host() -> int:
    """Bytes of CUDA tensors copied to host memory so far in this process, for every
    Communicator and every ringcomm process group (whose backend stages in C++ and counts here):
    none while their CUDA all_reduces run on the device path (Communicator.stats()["device"]
    says where)."""
    backend = _extension.loaded()
    return _to_host + (backend.bytes_staged() if backend is not None else 0)


def count_to_host(nbytes: int) -> None:
    """Adds `nbytes` staged to the host to bytes_to_host()."""
    global _to_host
    with _to_host_lock:
        _to_host += nbytes


def slice_bytes() -> int:
    """RINGCOMM_STAGING_SLICE_BYTES (default 4 MiB): one staged operation's payload."""
    value = env_int("RINGCOMM_STAGING_SLICE_BYTES")
    if value < 1:
        raise ValueError(f"RINGCOMM_STAGING_SLICE_BYTES must be positive, got {value}")
    return value


def _copy_streams(device: torch.device):
    with _streams_lock:
        pair = _streams.get(device.index)
        if pair is None:
            pair = _streams[device.index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return pair


class StagedWork:
    """The Work of a staged operation: done when every host operation is done and copied back."""

    def __init__(
        self,
        tensor: torch.Tensor,
        slices: list,
        done: torch.cuda.Event,
        future: torch.futures.Future,
    ):
        self._tensor, self._slices, self._done, self._future = tensor, slices, done, future
        self._lock = threading.Lock()
        self._observers = []  # _on_finish's functions, run before the future completes
        self._finished = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every slice is reduced (raising RingcommError if one failed), then makes
        the current stream wait for the copies back."""
        for work in self._slices:
            work.wait(timeout)
        torch.cuda.current_stream(self._tensor.device).wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._slices[-1].is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        for work in self._slices:
            error = work.exception()
            if error is not None:
                return error
        return None

    def result(self):
        self.wait()
        return self._tensor

    def source(self) -> int:
        return -1

    def stats(self) -> dict:
        """The slices' costs, summed."""
        total = {}
        for work in self._slices:
            for key, value in work.stats().items():
                total[key] = total.get(key, 0) + value
        return total

    def get_future(self) -> torch.futures.Future:
        """Completes with the tensor once every slice is back on the device (CUDA-aware: waiting
        on it, or on what it chains, makes the current stream wait for the copies)."""
        return self._future

    def _on_finish(self, fn):
        """As Work._on_finish: fn() runs once the operation is done, before the future
        completes (ringcomm.stats counts the bytes first)."""
        with self._lock:
            if not self._finished:
                self._observers.append(fn)
                return
        fn()

    def _run_observers(self):
        while True:  # observers added meanwhile run too
            with self._lock:
                observers, self._observers = self._observers, []
                if not observers:
                    self._finished = True
                    return
            for fn in observers:
                fn()


class _Staging:
    """One staged operation's copies: out to pinned host memory on one side stream, back on
    another, both after the work already on the caller's current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.to_host, self.to_device = _copy_streams(device)
        caller = torch.cuda.current_stream(device)
        self.to_host.wait_stream(caller)  # the tensors as the work before this call leaves them
        self.to_device.wait_stream(caller)

    def out(self, src: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event:
        """Enqueues host <- src; returns the event that says it is there."""
        count_to_host(host.nbytes)
        with torch.cuda.stream(self.to_host):
            host.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.to_host)
        src.record_stream(self.to_host)
        return ready

    def back(self, dst: torch.Tensor, host: torch.Tensor):
        """Enqueues dst <- host (on the progress thread, as an operation finishes)."""
        with torch.cuda.stream(self.to_device):
            dst.copy_(host, non_blocking=True)

    def work(self, result: torch.Tensor, works: list, async_op: bool):
        """The StagedWork of host operations `works` (in order), whose on_success copy back."""
        result.record_stream(self.to_device)
        done = torch.cuda.Event()
        future = torch.futures.Future(devices=[self.device])
        staged = StagedWork(result, works, done, future)
        key = (self.device.index, result.data_ptr())

        def finished():  # after the last operation: every copy back is enqueued (or it failed)
            staged._run_observers()
            error = staged.exception()
            with torch.cuda.stream(self.to_device):
                done.record(self.to_device)
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)  # records an event on to_device for its waiters
            with _pending_lock:
                if _pending.get(key) is staged:
                    del _pending[key]

        with _pending_lock:
            _pending[key] = staged
        works[-1]._on_finish(finished)
        if async_op:
            return staged
        staged.wait()
        return None


def _after_pending(tensor: torch.Tensor) -> None:
    """Waits for a staged operation still writing `tensor` (a second async call on the same
    tensor must see the first one's result, as on the CPU, where operations run in order); its
    wait() also orders the current stream after that operation's copies back."""
    with _pending_lock:
        pending = _pending.get((tensor.device.index, tensor.data_ptr()))
    if pending is not None:
        pending.wait()


def all_reduce(comm, tensor: torch.Tensor, op, algorithm: str, async_op: bool):
    """Communicator.all_reduce of a CUDA tensor, in slices."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (call .contiguous() first)")
    flat = tensor.view(-1)
    per_slice = max(1, slice_bytes() // tensor.element_size())
    bounds = [(a, min(a + per_slice, flat.numel())) for a in range(0, flat.numel(), per_slice)]
    bounds = bounds or [(0, 0)]  # an empty tensor still travels, and is checked
    host = torch.empty(flat.numel(), dtype=tensor.dtype, pin_memory=True)
    _after_pending(tensor)
    stage = _Staging(tensor.device)
    ready = [stage.out(flat[a:b], host[a:b]) for a, b in bounds]
    works = []
    for (a, b), event in zip(bounds, ready):
        event.synchronize()  # slice a:b is on the host: on the wire with it, while the rest copy
        works.append(
            comm._host_all_reduce(
                host[a:b],
                op,
                algorithm,
                on_success=lambda a=a, b=b: stage.back(flat[a:b], host[a:b]),
            )
        )
    return stage.work(tensor, works, async_op)


def sparse_all_reduce(comm, indices, values, numel: int, out, op, algorithm: str, async_op: bool):
    """Communicator.sparse_all_reduce with CUDA indices and values (the top-k of a CUDA
    gradient): the k pairs go to the host, the dense result comes back into `out` (a CUDA tensor,
    default a new float32 one on their device)."""
    device = values.device
    if indices.device != device:
        raise ValueError(f"indices are on {indices.device}, values on {device}")
    out = torch.empty(int(numel), dtype=torch.float32, device=device) if out is None else out
    if out.device != device:
        raise ValueError(f"out is on {out.device}, values on {device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    # Made contiguous on the current stream before the side stream is ordered after it.
    indices, values = indices.reshape(-1).contiguous(), values.reshape(-1).contiguous()
    _after_pending(out)
    stage = _Staging(device)
    host_indices = torch.empty(indices.numel(), dtype=indices.dtype, pin_memory=True)
    host_values = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
    host_out = torch.empty(out.numel(), dtype=out.dtype, pin_memory=True)
    stage.out(indices, host_indices)
    stage.out(values, host_values).synchronize()
    work = comm._host_sparse_all_reduce(
        host_indices,
        host_values,
        numel,
        host_out,
        op,
        algorithm,
        on_success=lambda: stage.back(out.view(-1), host_out),
    )
    return stage.work(out, [work], async_op) or out
