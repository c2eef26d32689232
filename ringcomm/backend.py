"""The torch.distributed backend "ringcomm": a C++ c10d::Backend over the ringcomm core.

    import ringcomm                                   # registers the backend
    dist.init_process_group("ringcomm")               # or with store=, rank=, world_size=
    dist.new_group([0, 1], backend="ringcomm")
    dist.init_process_group("cpu:ringcomm,cuda:nccl") # CPU tensors through ringcomm

torch wraps the backend in a named ProcessGroup as it does gloo, so everything built on process
groups works: subgroups, DeviceMesh, FSDP2, DTensor, functional collectives, DDP.

The backend (csrc/torch/backend.cc, ringcomm._C_torch) is compiled against the installed torch
the first time it is needed, with torch.utils.cpp_extension, and cached in
RINGCOMM_TORCH_BUILD_DIR (default ~/.cache/ringcomm): torch's C++ ABI changes between releases,
so it cannot ship prebuilt, and the core (libringcomm.so) never needs torch.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import threading
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import _C
from ._env import env_flag
from .communicator import Communicator

BACKEND_NAME = "ringcomm"
_PACKAGE = Path(__file__).resolve().parent

_MODULE_NAME = "ringcomm_C_torch"
_BUILT_STAMP = "ringcomm.built"  # there once a build has loaded: its library is whole
_module = None
_module_lock = threading.Lock()
_not_built = False  # built() found no finished build of this process's sources and torch
_cache_dir = None  # built()'s _build_dir, computed once


def _sources() -> Path:
    """The C++ tree the backend builds from: the checkout's csrc (editable installs), else the
    copy setup.py puts in the package."""
    for root in (_PACKAGE.parent / "csrc", _PACKAGE / "_csrc"):
        if (root / "torch" / "backend.cc").is_file():
            return root
    raise RuntimeError(f"ringcomm: the backend's C++ sources are missing (looked in "
                       f"{_PACKAGE.parent / 'csrc'} and {_PACKAGE / '_csrc'}); reinstall ringcomm")


def _build_dir(csrc: Path) -> Path:
    """One directory per torch version and source state: the backend links against both."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(csrc.rglob("*.h")) + [csrc / "torch" / "backend.cc"]:
        digest.update(str(path.relative_to(csrc)).encode() + path.read_bytes())
    base = os.environ.get("RINGCOMM_TORCH_BUILD_DIR") or Path.home() / ".cache" / "ringcomm"
    return Path(base) / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


def load():
    """ringcomm._C_torch: built on first use (a minute on two cores), loaded from the cache
    after. Safe to call from many processes at once: one builds, the others wait for it."""
    global _module
    with _module_lock:
        if _module is not None:
            return _module
        from torch.utils import cpp_extension

        csrc = _sources()
        build_dir = _build_dir(csrc)
        build_dir.mkdir(parents=True, exist_ok=True)
        # An flock dies with its holder, unlike cpp_extension's own lock file, which a build
        # killed half-way leaves behind for every later process to wait on forever.
        with open(build_dir / "ringcomm.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            (build_dir / _BUILT_STAMP).unlink(missing_ok=True)  # until this build has loaded
            _module = cpp_extension.load(
                name=_MODULE_NAME,
                sources=[str(csrc / "torch" / "backend.cc")],
                extra_include_paths=[str(csrc)],
                extra_cflags=["-O2"],
                # No rpath: _C (imported above) has loaded libringcomm.so already, and the loader
                # binds this module to it by its soname, so a cached build serves any
                # installation of the same sources and the process has one core.
                # --exclude-libs: as CMakeLists.txt says, for toolchains that link libstdc++
                # statically.
                extra_ldflags=[f"-L{_PACKAGE}", "-lringcomm", "-Wl,--exclude-libs,ALL"],
                build_directory=str(build_dir),
                verbose=env_flag("RINGCOMM_DEBUG"),
            )
            (build_dir / _BUILT_STAMP).touch()
        return _module


def built():
    """ringcomm._C_torch if this process has loaded it or a finished build of it is in the cache
    (loaded then, in about 0.1 s), else None. For callers that use it only to go faster
    (fusion.BufferList): this never starts the minute-long build and never waits for one; a
    process that finds no finished build in the cache stops looking."""
    global _module, _not_built, _cache_dir
    if _module is not None or _not_built:
        return _module
    if not _module_lock.acquire(blocking=False):  # load() is building or loading it
        return None
    try:
        if _module is not None or _not_built:
            return _module
        if _cache_dir is None:
            _cache_dir = _build_dir(_sources())
        path = _cache_dir / f"{_MODULE_NAME}.so"
        if not (_cache_dir / _BUILT_STAMP).is_file() or not path.is_file():
            _not_built = True
            return None
        with open(_cache_dir / "ringcomm.lock", "r") as lock:
            # a rebuild in progress holds it exclusively (its library may be half written):
            # look again on a later call
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _module = module
    except BlockingIOError:
        pass
    except Exception:  # best effort, once: the caller has a path without it
        _not_built = True
    finally:
        _module_lock.release()
    return _module


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
            raise ValueError(f"{group!r} is not a process group with a ringcomm backend for CPU "
                             "tensors")
        core = _C.Communicator.from_capsule(backend.communicator_capsule())
        comm = Communicator._borrow(core, timedelta(minutes=10))
        _borrowed[group] = comm
        return comm
