import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import ranks  # noqa: E402

# The suite's ranks use the fixed default link model, not one probed at connect: which algorithm
# "auto" picks, and so the bits of every result, must not depend on how busy the machine is.
# tests/test_select.py probes.
os.environ["RINGCOMM_TUNING"] = "off"

# One OpenMP thread per process, as torchrun sets for several ranks per host: the tests run up to
# 5 ranks on 2 cores, and torch's idle OpenMP workers spin after every parallel op, taking the
# CPU from the ranks that do the work (58% of the samples of a 5-rank test, 3.7x its time). Set
# before ranks.py starts its fork server, so every rank and every launched script inherits it.
os.environ["OMP_NUM_THREADS"] = "1"

# The modules that take longest, longest first:
# `make test`'s workers take modules in collection order, and one started last would run alone at
# the end.
FIRST = (
    "test_hooks",
    "test_powersgd",
    "test_errors",
    "test_clients",
    "test_launchers",
    "test_bench",
    "test_fusion",
    "test_backend",
    "test_topk_hook",
    "test_trace",
    "test_torch_suite",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(FIRST)))  # stable


def pytest_generate_tests(metafunc):
    """Tests marked every_transport (a module's pytestmark) run once per transport
    (ranks.TRANSPORTS), but those marked transport_fixed; the others use the default
    (RINGCOMM_TRANSPORT=auto: shared memory between the local ranks)."""
    if (
        metafunc.definition.get_closest_marker("every_transport") is not None
        and metafunc.definition.get_closest_marker("transport_fixed") is None
    ):
        metafunc.parametrize("transport", sorted(ranks.TRANSPORTS), indirect=True)


@pytest.fixture(scope="session", autouse=True)
def temporary_files(tmp_path_factory):
    """The suite's processes (ranks, torchrun's agents, which leave their torchelastic_*
    directories behind) write their temporary files under pytest's own temporary directory,
    which pytest removes a few runs later, not straight into /tmp."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # read TMPDIR again


@pytest.fixture(autouse=True)
def transport(request):
    ranks.transport = getattr(request, "param", None)
    yield ranks.transport
    ranks.transport = None
