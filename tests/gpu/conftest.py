"""GPU tests: every test here needs ringcomm's CUDA kernels and a CUDA device, and is skipped,
with the reason, where there is none (never failed for its absence). bench/gpu_check.sh runs
them on a GPU machine."""

import pytest

import ringcomm.cuda


def pytest_collection_modifyitems(config, items):
    ok, reason = ringcomm.cuda.status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no GPU to run on: {reason}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
