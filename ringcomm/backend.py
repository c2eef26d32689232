"""The torch.distributed backend "ringcomm": a C++ c10d::Backend over the ringcomm core.

    import ringcomm                                   # registers the backend
    dist.init_process_group("ringcomm")               # or with store=, rank=, world_size=
    dist.new_group([0, 1], backend="ringcomm")
    dist.init_process_group("cpu:ringcomm,cuda:nccl") # CPU tensors through ringcomm

torch wraps the backend in a named ProcessGroup as it does gloo, so everything built on process
groups works: subgroups, DeviceMesh, FSDP2, DTensor, functional collectives, DDP.

CUDA tensors: all_reduce (and its coalesced form, DDP's) runs on the group's device path
(ringcomm.device: CUDA IPC between ranks of one host, any number of them per GPU, or NCCL) with
ProcessGroupNCCL's stream semantics; every other operation on CUDA tensors, and every one on a
device no device transport reaches, is staged through pinned host memory by the backend, counted
in ringcomm.staging.bytes_to_host() and logged at INFO on the "ringcomm" logger, once per
operation and device. DDP hooks given the group as their state share its device path.

The backend (csrc/torch/backend.cc, ringcomm._C_torch) is compiled against the installed torch
the first time it is needed, and cached (_extension.py): load() builds it, built() says whether
a build is there.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C
from ._extension import built as built, load  # built: for the callers of backend.built()
from .communicator import DEVICE_TRANSPORTS, Communicator
from .device import DevicePaths

BACKEND_NAME = "ringcomm"

logger = logging.getLogger("ringcomm")


class _DeviceRoute:
    """Where a ringcomm process group's operations on CUDA tensors run, asked by its backend
    (csrc/torch/backend.cc) with the GIL: all_reduce and allreduce_coalesced on the group's
    device paths (which log, once per device, why one stages); the backend stages the rest."""

    def __init__(self, paths: DevicePaths):
        self.paths = paths
        self._logged = set()

    def __call__(self, tensors: list, reduce_op: int, factor):
        """Enqueues an all_reduce of each of `tensors` (one CUDA device) by `reduce_op` (a core
        op code), each first scaled by `factor` where it is not None, on the device path after
        the work on the current stream, and returns the stream it runs on as (stream_id,
        device_index, device_type); None where no device path serves: the backend stages."""
        path = self.paths.get(tensors[0].device)
        if path is None:
            return None
        if factor is not None:
            for t in tensors:
                t.mul_(factor)
        stream = path.all_reduce_stream(tensors, reduce_op)
        return stream.stream_id, stream.device_index, stream.device_type

    def staged(self, op: str, device: str) -> None:
        """Logs, once per operation and device, that the backend stages `op`."""
        if (op, device) not in self._logged:
            self._logged.add((op, device))
            logger.info(
                "ringcomm: rank %d of %d stages %s of CUDA tensors on %s through host memory: "
                "the device path carries all_reduce alone",
                self.paths.rank,
                self.paths.world_size,
                op,
                device,
            )

    def close(self) -> None:
        self.paths.close()

    def abort(self) -> None:
        self.paths.abort()


def _create(store, rank: int, world_size: int, timeout: timedelta):
    backend = load().RingcommBackend(store, rank, world_size, timeout)
    paths = DevicePaths(
        dist.PrefixStore("ringcomm/device", store), rank, world_size, timeout, DEVICE_TRANSPORTS
    )
    backend.set_device_route(_DeviceRoute(paths))
    return backend


def register_backend():
    """Registers "ringcomm" with torch.distributed (done on `import ringcomm`; idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        # One backend serves both device types (module docstring).
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


def backend_of(group=None):
    """The ringcomm backend behind `group`'s CPU tensors (default: the default group), or None."""
    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in a _ProcessGroupWrapper.
    backend = getattr(backend, "wrapped_pg", backend)
    return backend if isinstance(backend, load().RingcommBackend) else None


# The borrowed Communicator of each group: hooks ask for it on every bucket.
_borrowed = weakref.WeakKeyDictionary()
_borrowed_lock = threading.Lock()


def communicator_of(group=None) -> Communicator:
    """A ringcomm.Communicator over the same core communicator as `group`'s ringcomm backend:
    operations issued through either run in one order. The group owns it (close() does nothing)."""
    group = group if group is not None else dist.group.WORLD
    with _borrowed_lock:
        comm = _borrowed.get(group) if isinstance(group, dist.ProcessGroup) else None
        if comm is not None:
            return comm
        backend = backend_of(group)
        if backend is None:
            raise ValueError(
                f"{group!r} is not a process group with a ringcomm backend for CPU tensors"
            )
        core = _C.Communicator.from_capsule(backend.communicator_capsule())
        comm = Communicator._borrow(core, timedelta(minutes=10), backend.device_route().paths)
        _borrowed[group] = comm
        return comm
