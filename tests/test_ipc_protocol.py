"""The CUDA IPC transport's signals and the window plans it runs (csrc/transport/cuda_ipc/
ipc_protocol.h, csrc/algorithms/window_plan.h), on the host: real processes over shared memory
run the one-shot, shared-buffer and ring all-reduces action by action, for 1 to 8 ranks, and the
bounded waits meet a peer that never arrives, an abort word set by another process, and counts
left from the last operation; the posts of operations' signatures find a rank that issued another
operation and nothing where all agree; sends and receives run beside all-reduces, as on streams of
their own, and their posts find a receive of another size (tests/native/ipc_protocol.cc). No GPU
needed."""

import subprocess

import pytest

from ranks import build_native


@pytest.fixture(scope="module")
def ipc_protocol(tmp_path_factory):
    return build_native("ipc_protocol", str(tmp_path_factory.mktemp("native")))


@pytest.mark.parametrize("mode", ["plans", "timeout", "abort", "stale", "agree", "messages"])
def test_ipc_protocol(ipc_protocol, mode):
    run = subprocess.run([ipc_protocol, mode], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
