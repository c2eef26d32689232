"""The torch backend's module, ringcomm._C_torch (csrc/torch/backend.cc): compiled against the
installed torch the first time it is needed, with torch.utils.cpp_extension, and cached in
RINGCOMM_TORCH_BUILD_DIR (default ~/.cache/ringcomm). torch's C++ ABI changes between releases,
so it cannot ship prebuilt, and the core (libringcomm.so) never needs torch.

load() builds it or loads the build (the "ringcomm" process groups of backend.py run on it);
built() only loads a finished build (fusion.py and cuda.py read tensor lists with it where it
is, in Python where it is not). Of ringcomm, this module imports only the core and its knobs,
so any module can import it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import threading
from pathlib import Path

import torch

from . import _C  # noqa: F401 - loads libringcomm.so, which the module binds to (see load())
from ._env import env_flag, env_string

_PACKAGE = Path(__file__).resolve().parent
_MODULE_NAME = "ringcomm_C_torch"
_BUILT_STAMP = "ringcomm.built"  # there once a build has loaded: its library is whole
_module = None
_module_lock = threading.Lock()
_not_built = False  # built() found no finished build of this process's sources and torch
_cache_dir = None  # built()'s build_dir, computed once


def sources() -> Path:
    """The C++ tree the backend builds from: the checkout's csrc (editable installs), else the
    copy setup.py puts in the package."""
    for root in (_PACKAGE.parent / "csrc", _PACKAGE / "_csrc"):
        if (root / "torch" / "backend.cc").is_file():
            return root
    raise RuntimeError(
        f"ringcomm: the backend's C++ sources are missing (looked in "
        f"{_PACKAGE.parent / 'csrc'} and {_PACKAGE / '_csrc'}); reinstall ringcomm"
    )


def build_dir(csrc: Path) -> Path:
    """One directory per torch version and source state: the backend links against both."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(csrc.rglob("*.h")) + [csrc / "torch" / "backend.cc"]:
        digest.update(str(path.relative_to(csrc)).encode() + path.read_bytes())
    base = Path(env_string("RINGCOMM_TORCH_BUILD_DIR")).expanduser()
    return base / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


def load():
    """ringcomm._C_torch: built on first use (a minute on two cores), loaded from the cache
    after. Safe to call from many processes at once: one builds, the others wait for it."""
    global _module
    with _module_lock:
        if _module is not None:
            return _module
        from torch.utils import cpp_extension

        csrc = sources()
        directory = build_dir(csrc)
        directory.mkdir(parents=True, exist_ok=True)
        # An flock dies with its holder, unlike cpp_extension's own lock file, which a build
        # killed half-way leaves behind for every later process to wait on forever.
        with open(directory / "ringcomm.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            (directory / _BUILT_STAMP).unlink(missing_ok=True)  # until this build has loaded
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
                build_directory=str(directory),
                verbose=env_flag("RINGCOMM_DEBUG"),
            )
            (directory / _BUILT_STAMP).touch()
        return _module


def loaded():
    """ringcomm._C_torch if this process has loaded it, else None."""
    return _module


def built():
    """ringcomm._C_torch if this process has loaded it or a finished build of it is in the cache
    (loaded then, in about 0.1 s), else None. For callers that use it only to go faster
    (fusion.BufferList, cuda.pack): this never starts the minute-long build and never waits for
    one; a process that finds no finished build in the cache stops looking."""
    global _module, _not_built, _cache_dir
    if _module is not None or _not_built:
        return _module
    if not _module_lock.acquire(blocking=False):  # load() is building or loading it
        return None
    try:
        if _module is not None or _not_built:
            return _module
        if _cache_dir is None:
            _cache_dir = build_dir(sources())
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
