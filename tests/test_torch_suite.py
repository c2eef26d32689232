"""torch's own DistributedTest on ringcomm (tests/torch_suite.py): the whole selection, each test
as expected (passed; skipped, or failed for a known reason, as listed there). `python
tests/torch_suite.py` runs it on gloo and ringcomm side by side: every test passes on gloo."""
import pytest

import torch_suite

pytest.importorskip("expecttest")  # torch.testing._internal needs it


def test_torch_distributed_suite_passes_on_ringcomm():
    outcomes = torch_suite.run("ringcomm", torch_suite.SELECTION, timeout=400)
    unexpected = {n: o for n, o in outcomes.items() if o != torch_suite.expected(n)}
    assert len(outcomes) == len(torch_suite.SELECTION) and not unexpected, unexpected
