"""Posting a message allocates nothing: heap allocations per call do not grow with the number of
messages a call sends (tests/native/count_allocations.cc, real ranks, C++ only)."""

import os
import subprocess

import pytest

from ranks import build_native


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return build_native("count_allocations", str(tmp_path_factory.mktemp("native")))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_allocations_per_call_do_not_grow_with_messages(counter, tmp_path, transport, world):
    run = subprocess.run(
        [counter, str(world), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RINGCOMM_TRANSPORT": transport},
    )
    assert run.returncode == 0, run.stderr
    rows = [line.rsplit(" ", 2) for line in run.stdout.splitlines()]
    assert len(rows) == 4, run.stdout
    for name, small, large in rows:
        # A 4 MiB call sends tens of messages per step, an 8-byte one a single message: one
        # allocation per message would add tens per call. A queue or table that grows to a new
        # high-water mark now and then (more in flight on a loaded machine) adds a fraction.
        assert float(large) <= float(small) + 1, (
            f"{name}: {small} allocations per small call, {large} per large"
        )
