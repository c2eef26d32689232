"""torch's own DistributedTest on ringcomm (tests/torch_suite.py): CI runs a part of the selection
(the whole takes minutes; `python tests/torch_suite.py` runs it on gloo and ringcomm side by
side). Every test there passes on gloo."""
import pytest

import torch_suite

pytest.importorskip("expecttest")  # torch.testing._internal needs it


def test_torch_distributed_suite_passes_on_ringcomm():
    outcomes = torch_suite.run("ringcomm", torch_suite.CI_SELECTION, timeout=400)
    failed = sorted(n for n, o in outcomes.items() if o != "passed")
    assert len(outcomes) == len(torch_suite.CI_SELECTION) and not failed, outcomes
