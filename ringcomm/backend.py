"""The torch.distributed backend "ringcomm": a Python ProcessGroup over a ringcomm Communicator.

    import ringcomm                                   # registers the backend
    dist.init_process_group("ringcomm")               # or with store=, rank=, world_size=
    dist.new_group([0, 1], backend="ringcomm")
    dist.init_process_group("cpu:ringcomm,cuda:nccl") # CPU tensors through ringcomm

Every op returns a Work at once; its get_future() completes on ringcomm's progress thread. The
collectives the C++ core has (all_reduce, broadcast, reduce, all_gather, reduce_scatter, barrier,
send/recv) map onto it directly; gather, scatter and all-to-all are point-to-point exchanges
issued here over the core's send/recv.
"""
from __future__ import annotations

import functools
import threading
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .communicator import Communicator

BACKEND_NAME = "ringcomm"


class _FutureWork(dist._Work):
    """A torch Work that is done when `future` is.

    Not torch's _create_work_from_future: that Work's wait() returns normally when the future
    failed, so a collective that lost a peer would look like a success.
    """

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        # C++ callers pass a zero duration for "no timeout".
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds:
            finished = threading.Event()
            self._future.add_done_callback(lambda _: finished.set())
            if not finished.wait(seconds):
                raise RuntimeError(f"ringcomm: timed out after {seconds}s waiting for the operation")
        self._future.wait()  # raises the operation's error, if any
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as e:  # noqa: BLE001 - the operation's own error, handed back as is
            return e
        return None


def _when_done(works, result, finish=None) -> _FutureWork:
    """A Work completed with `result` once every ringcomm Work in `works` has finished and then
    `finish()` (a copy out of temporaries) has run; failed with the first error otherwise."""
    futures = [w.get_future() for w in works]

    def complete(_):
        for f in futures:
            f.value()  # raises the first failure
        if finish is not None:
            finish()
        return result

    if not futures:
        done = torch.futures.Future()
        done.set_result(complete(None))
        return _FutureWork(done)
    combined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
    return _FutureWork(combined.then(complete))


def _one(tensors, what="tensors"):
    if len(tensors) != 1:
        raise ValueError(f"expected one tensor in {what} (one device per process), "
                         f"got {len(tensors)}")
    return tensors[0]


def _pairs(outputs, inputs):
    if len(outputs) != len(inputs):
        raise ValueError(f"got {len(outputs)} outputs for {len(inputs)} inputs")
    return zip(outputs, inputs)


def _first_tensor(args) -> Optional[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            found = _first_tensor(a)
            if found is not None:
                return found
    return None


def _op(method):
    """Marks a ProcessGroup op: tensors on a non-CPU device go to the backend the group's config
    names for that device; argument errors name the op."""
    name = method.__name__

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        tensor = _first_tensor(args + tuple(kwargs.values()))
        if tensor is not None and tensor.device.type != "cpu":
            return getattr(self._device_group(tensor.device, name), name)(*args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except (TypeError, ValueError) as e:
            raise type(e)(f"ringcomm {name}: {e}") from e

    return run


def _unsupported(name: str, why: str):
    def op(self, *args, **kwargs):
        raise NotImplementedError(f"the ringcomm backend does not support {name}: {why}")

    op.__name__ = name
    return op


def _check_tag(tag: int):
    if tag != 0:
        raise ValueError(f"tag={tag}: ringcomm matches send/recv between two ranks in issue "
                         "order and has no tags; use tag 0")


class ProcessGroupRingcomm(dist.ProcessGroup):
    """One rank's view of a ringcomm process group (see the module docstring)."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta):
        super().__init__(rank, world_size)
        self._store = store
        self._timeout = timeout
        # The store is already private to this group (torch prefixes it with the group's name), so
        # a fixed communicator name is unique; a counted default would differ between ranks that
        # belong to different subgroups.
        self.communicator = Communicator(store, rank, world_size, timeout, name="pg")
        self._device_groups = {}
        self._device_groups_lock = threading.Lock()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self):
        return f"ProcessGroupRingcomm(rank={self.rank()}, size={self.size()})"

    # -- collectives the core has -----------------------------------------------------------

    @_op
    def allreduce(self, tensors, opts=None):
        # DDP's join mode calls allreduce(tensor) with no options.
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        op = opts.reduceOp if opts is not None else "sum"
        work = self.communicator.all_reduce(_one(tensors), op=op, async_op=True)
        return _when_done([work], tensors)

    @_op
    def allreduce_coalesced(self, tensors, opts):
        if len({t.dtype for t in tensors}) > 1:
            raise TypeError("all tensors must have the same dtype, got "
                            + ", ".join(sorted({str(t.dtype) for t in tensors})))
        flat = _flatten_dense_tensors(tensors)

        def unflatten():
            for t, piece in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                t.copy_(piece)

        work = self.communicator.all_reduce(flat, op=opts.reduceOp, async_op=True)
        return _when_done([work], tensors, unflatten)

    @_op
    def broadcast(self, tensors, opts):
        t = _one(tensors)
        return _when_done([self.communicator.broadcast(t, opts.rootRank, async_op=True)], tensors)

    @_op
    def reduce(self, tensors, opts):
        t = _one(tensors)
        work = self.communicator.reduce(t, opts.rootRank, op=opts.reduceOp, async_op=True)
        return _when_done([work], tensors)

    @_op
    def allgather(self, output_tensors, input_tensors, opts):
        outputs = _one(output_tensors, "output_tensors")
        inputs = _one(input_tensors, "input_tensors")
        work = self.communicator.all_gather(outputs, inputs, async_op=True)
        return _when_done([work], output_tensors)

    @_op
    def allgather_coalesced(self, output_lists, input_list, opts):
        works = [self.communicator.all_gather(o, i, async_op=True)
                 for o, i in _pairs(output_lists, input_list)]
        return _when_done(works, output_lists)

    @_op
    def all_gather_single(self, output, input, opts):
        return _when_done([self.communicator.all_gather(output, input, async_op=True)], [output])

    @_op
    def all_gather_single_coalesced(self, outputs, inputs, opts):
        works = [self.communicator.all_gather(o, i, async_op=True)
                 for o, i in _pairs(outputs, inputs)]
        return _when_done(works, outputs)

    @_op
    def reduce_scatter(self, output_tensors, input_tensors, opts):
        output = _one(output_tensors, "output_tensors")
        inputs = _one(input_tensors, "input_tensors")
        work = self.communicator.reduce_scatter(output, inputs, op=opts.reduceOp, async_op=True)
        return _when_done([work], output_tensors)

    @_op
    def reduce_scatter_single(self, output, input, opts):
        work = self.communicator.reduce_scatter(output, input, op=opts.reduceOp, async_op=True)
        return _when_done([work], [output])

    @_op
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self.communicator.reduce_scatter(o, i, op=opts.reduceOp, async_op=True)
                 for o, i in _pairs(outputs, inputs)]
        return _when_done(works, outputs)

    @_op
    def barrier(self, opts):
        return _when_done([self.communicator.barrier(async_op=True)], [])

    @_op
    def send(self, tensors, dst, tag):
        _check_tag(tag)
        return _when_done([self.communicator.isend(_one(tensors), dst)], tensors)

    @_op
    def recv(self, tensors, src, tag):
        _check_tag(tag)
        return _when_done([self.communicator.irecv(_one(tensors), src)], tensors)

    # -- point-to-point exchanges (the core has no gather, scatter or all-to-all) ------------

    @_op
    def gather(self, output_tensors, input_tensors, opts):
        comm, root = self.communicator, self._root(opts)
        t = _one(input_tensors, "input_tensors")
        if comm.rank != root:
            return _when_done([comm.isend(t, root)], output_tensors)
        outputs = self._per_rank(_one(output_tensors, "output_tensors"), "output list")
        outputs[root].copy_(t)
        return _when_done([comm.irecv(outputs[r], r) for r in self._peers()], output_tensors)

    @_op
    def scatter(self, output_tensors, input_tensors, opts):
        comm, root = self.communicator, self._root(opts)
        t = _one(output_tensors, "output_tensors")
        if comm.rank != root:
            return _when_done([comm.irecv(t, root)], output_tensors)
        inputs = self._per_rank(_one(input_tensors, "input_tensors"), "input list")
        t.copy_(inputs[root])
        return _when_done([comm.isend(inputs[r], r) for r in self._peers()], output_tensors)

    @_op
    def alltoall(self, output_tensors, input_tensors, opts):
        return self._exchange(self._per_rank(output_tensors, "output list"),
                              self._per_rank(input_tensors, "input list"), output_tensors)

    @_op
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        outputs = self._split_rows(output, output_split_sizes, "output")
        inputs = self._split_rows(input, input_split_sizes, "input")
        return self._exchange(outputs, inputs, [output])

    def _exchange(self, outputs, inputs, result):
        comm = self.communicator
        outputs[comm.rank].copy_(inputs[comm.rank])
        # All posted before any is waited on: the core progresses them together, so the order in
        # which ranks post them cannot deadlock.
        works = [comm.irecv(outputs[r], r) for r in self._peers()]
        works += [comm.isend(inputs[r], r) for r in self._peers()]
        return _when_done(works, result)

    def _root(self, opts) -> int:
        return self.communicator._check_rank(opts.rootRank, "root")

    def _peers(self):
        return [r for r in range(self.size()) if r != self.rank()]

    def _per_rank(self, tensors, what):
        if len(tensors) != self.size():
            raise ValueError(f"{what} needs {self.size()} tensors (one per rank), got {len(tensors)}")
        return tensors

    def _split_rows(self, t, split_sizes, what):
        """Views of `t` along dim 0, one per rank: split_sizes rows each, or equal parts."""
        n = self.size()
        if not split_sizes:
            if t.dim() == 0 or t.shape[0] % n:
                raise ValueError(f"{what} of shape {tuple(t.shape)} does not split evenly into "
                                 f"{n} parts along dim 0; pass split sizes")
            split_sizes = [t.shape[0] // n] * n
        if len(split_sizes) != n or sum(split_sizes) != t.shape[0]:
            raise ValueError(f"{what} split sizes {list(split_sizes)} must be {n} row counts "
                             f"adding up to {t.shape[0]}")
        return list(torch.split(t, list(split_sizes)))

    # -- not supported -----------------------------------------------------------------------

    recv_anysource = _unsupported("recv_anysource", "receives need a source rank (pass src=)")
    # torch's _coalescing_manager(device=...) calls this from Python (the base class would fail
    # with "No backend type associated with device type cpu").
    _start_coalescing = _unsupported("_start_coalescing", "use torch's _coalescing_manager without "
                                     "a device (coalesced all_reduce, all_gather, reduce_scatter)")

    # -- other devices (mixed backends such as "cpu:ringcomm,cuda:nccl") ----------------------

    def _device_group(self, device: torch.device, op: str) -> dist.ProcessGroup:
        """The process group for tensors on `device`, created on first use from the backend this
        group's config names for that device type.

        torch hands a custom backend that is a ProcessGroup the whole group, so it never builds
        the other backends of a mixed config itself; all ranks reach the first op on a device
        together, which makes creating it then collective-safe.
        """
        kind = device.type
        with self._device_groups_lock:
            group = self._device_groups.get(kind)
            if group is None:
                config = dict(pair.split(":") for pair in dist.get_backend_config(self).split(","))
                backend = config.get(kind)
                if backend is None or backend == BACKEND_NAME:
                    raise ValueError(
                        f"ringcomm {op}: ringcomm moves CPU tensors, got a tensor on {device}; "
                        f"name a backend for {kind}, e.g. "
                        f"init_process_group('cpu:ringcomm,{kind}:nccl')")
                group = _make_device_group(kind, backend, dist.PrefixStore(f"{kind}/", self._store),
                                           self.rank(), self.size(), self._timeout)
                self._device_groups[kind] = group
        return group

    # -- lifetime ----------------------------------------------------------------------------

    def shutdown(self):
        self.communicator.close()

    def abort(self):
        # The core has no abort: close() lets queued operations finish first, each bounded by the
        # group's timeout (and failing at once if a peer is gone).
        self.communicator.close()


def _make_device_group(device_type: str, backend: str, store, rank: int, size: int,
                       timeout: timedelta) -> dist.ProcessGroup:
    if backend == "gloo":
        impl = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
    elif backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = dist.ProcessGroupNCCL(store, rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        plugin = dist.Backend._plugins.get(backend.upper())
        if plugin is None or plugin.extended_api:
            raise ValueError(f"ringcomm cannot create backend {backend!r} for {device_type} "
                             "tensors; supported: gloo, nccl, or a backend registered without "
                             "extended_api")
        impl = plugin.creator_fn(store, rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.CUSTOM
        if isinstance(impl, dist.ProcessGroup):
            return impl
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device(device_type), kind, impl)
    group._set_default_backend(kind)
    return group


def _create(store, rank: int, world_size: int, timeout: timedelta) -> ProcessGroupRingcomm:
    return ProcessGroupRingcomm(store, rank, world_size, timeout)


def register_backend():
    """Registers "ringcomm" with torch.distributed (done on `import ringcomm`; idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
