"""PyTorch Lightning on the ringcomm backend: examples/lightning_digits.py (DDPStrategy with
process_group_backend="ringcomm", sync_dist metrics, scikit-learn's digits) under torchrun on 2
ranks, as is and under TORCH_DISTRIBUTED_DEBUG=DETAIL, against the same run on gloo."""

import re
from pathlib import Path

import pytest

from ranks import run_torchrun

pytest.importorskip("lightning")

SCRIPT = (Path(__file__).parent.parent / "examples" / "lightning_digits.py").read_text()


def accuracies(tmp_path, backend):
    stdout = run_torchrun(tmp_path, SCRIPT, 2, timeout=180, args=[backend])
    found = re.findall(r"RESULT backend=(\w+) rank=(\d) val_acc=([\d.]+)", stdout)
    assert len(found) == 2 and all(b == backend for b, _, _ in found), stdout
    return [float(acc) for _, _, acc in found]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    return accuracies(tmp_path_factory.mktemp("gloo"), "gloo")


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_lightning_ddp_trains_like_gloo(tmp_path, monkeypatch, gloo, debug):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", debug)
    ringcomm = accuracies(tmp_path, "ringcomm")
    assert ringcomm[0] == ringcomm[1]  # the metric is synchronised
    assert ringcomm[0] > 0.9, ringcomm
    assert abs(ringcomm[0] - gloo[0]) <= 0.01, (ringcomm, gloo)
