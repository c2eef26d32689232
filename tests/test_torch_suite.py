"""torch's own DistributedTest on ringcomm (tests/torch_suite.py): the whole selection, each test
as expected (passed; skipped, or failed for a known reason, as listed there), as is and under
TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's wrapper checks every collective's fingerprint and
ringcomm's sequence number first). `python tests/torch_suite.py` runs it on gloo and ringcomm
side by side."""

import pytest

import torch_suite

pytest.importorskip("expecttest")  # torch.testing._internal needs it


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_torch_distributed_suite_passes_on_ringcomm(debug):
    messages = {}
    outcomes = torch_suite.run(
        "ringcomm", torch_suite.SELECTION, timeout=400, debug=debug, messages=messages
    )
    unexpected = {
        n: (o, messages.get(n, "")[-1000:])
        for n, o in outcomes.items()
        if o != torch_suite.expected(n)
    }
    assert len(outcomes) == len(torch_suite.SELECTION) and not unexpected, unexpected
