"""The torch.distributed backend "ringcomm": a C++ c10d::Backend over the ringcomm core.

    import ringcomm                                   # registers the backend
    dist.init_process_group("ringcomm")               # or with store=, rank=, world_size=
    dist.new_group([0, 1], backend="ringcomm")
    dist.init_process_group("cpu:ringcomm,cuda:nccl") # CPU tensors through ringcomm

torch wraps the backend in a named ProcessGroup as it does gloo, so everything built on process
groups works: subgroups, DeviceMesh, FSDP2, DTensor, functional collectives, DDP.

The backend (csrc/torch/backend.cc, ringcomm._C_torch) is compiled against the installed torch
the first time it is needed, and cached (_extension.py): load() builds it, built() says whether
a build is there.
"""

from __future__ import annotations

import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C
from ._extension import built as built, load  # built: for the callers of backend.built()
from .communicator import Communicator

BACKEND_NAME = "ringcomm"


def _create(store, rank: int, world_size: int, timeout: timedelta):
    return load().RingcommBackend(store, rank, world_size, timeout)


def register_backend():
    """Registers "ringcomm" with torch.distributed (done on `import ringcomm`; idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        # One backend serves both device types: CUDA tensors are staged through pinned host
        # memory (csrc/torch/backend.cc).
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
        comm = Communicator._borrow(core, timedelta(minutes=10))
        _borrowed[group] = comm
        return comm
