"""The NCCL transport's host side, on a machine without a GPU: finding and loading libnccl.so.2
(the nvidia-nccl-cu13 wheel of the test extras), NCCL's own unique id, and clear errors for a
missing library, a library that is not NCCL, and a communicator with no GPU to run on. The
transport's schedules are checked in tests/test_schedule.py; its GPU runs are tests/gpu/."""

import os
import subprocess
import sys

import pytest

import ringcomm.cuda
import ringcomm.nccl

pytestmark = pytest.mark.skipif(
    not ringcomm.cuda.built(), reason="ringcomm was built without its CUDA extension"
)


def run(code, **env):
    """Runs `code` in a fresh interpreter (NCCL is loaded once per process)."""
    environment = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )


def test_the_nccl_wheel_is_found_and_gives_unique_ids():
    path = ringcomm.nccl.library_path()
    if path == "libnccl.so.2":
        pytest.fail("the nvidia-nccl-cu13 wheel (test extras) is not installed")
    assert os.path.exists(path), path
    r = run(
        "import ringcomm.nccl as n; a = n.unique_id(); b = n.unique_id(); "
        "print(len(a), len(b), a != b)"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["128", "128", "True"]


def test_missing_library_is_a_clear_error():
    r = run(
        "import ringcomm.nccl as n; n.unique_id()",
        RINGCOMM_NCCL_LIBRARY="/nonexistent/libnccl.so.2",
    )
    assert r.returncode != 0
    assert "RingcommError: cannot load the NCCL library /nonexistent/libnccl.so.2" in r.stderr
    assert "RINGCOMM_NCCL_LIBRARY" in r.stderr


def test_a_library_that_is_not_nccl_is_refused():
    r = run("import ringcomm.nccl as n; n.unique_id()", RINGCOMM_NCCL_LIBRARY="libc.so.6")
    assert r.returncode != 0
    assert "NCCL library libc.so.6 has no ncclGetVersion" in r.stderr


def test_no_communicator_without_a_gpu():
    ok, reason = ringcomm.cuda.status()
    if ok:
        pytest.skip("this machine has a GPU: tests/gpu/test_nccl.py runs instead")
    import torch

    with pytest.raises(RuntimeError, match="no NCCL communicator: .*no CUDA"):
        ringcomm.nccl.NcclCommunicator(torch.distributed.HashStore(), 0, 1)


def test_library_path_order(monkeypatch):
    monkeypatch.setenv("RINGCOMM_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2")
    assert ringcomm.nccl.library_path() == "/opt/nccl/libnccl.so.2"
    monkeypatch.delenv("RINGCOMM_NCCL_LIBRARY")
    assert ringcomm.nccl.library_path().endswith("libnccl.so.2")
