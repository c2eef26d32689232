"""Fault injection, the short fixed selection: every fault kind (kill -9, a socket shut down
mid-message, all of a rank's sockets shut down, a SIGSTOP stall) on every transport (shm, tcp,
mixed), 2-4 real ranks, through the one engine in bench/reliability/faults.py (run with --ci;
the long randomized run is `bench/reliability/faults.py --trials 200`).

The engine runs as its own process: its ranks fork from a fork server that imports the bench
script as __main__, which is cleanest outside pytest's process. Bounds here are generous (3 s on
a loaded 2-core machine); the bench reports the real figures.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "reliability" / "faults.py"
CASES = [
    f"{kind}-{transport}"
    for kind in ("kill", "close_all", "close_one", "stall")
    for transport in ("shm", "tcp", "mixed")
]
BOUND_S = 3.0  # detection, or for a stall time past the communicator timeout


# Each trial compares /dev/shm and the listening ports before and after it, and bounds times:
# alone, not beside other tests.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "faults.json"
    # Its own process group: if it overruns, its fork server and ranks (a stopped one included)
    # go with it.
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--ci", "--seed", "0", "--json", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        pytest.fail(f"bench/reliability/faults.py --ci ran over 300 s:\n{stdout[-4000:]}")
    assert out.exists(), f"bench/reliability/faults.py --ci wrote no report:\n{stdout[-6000:]}"
    return json.loads(out.read_text()), stdout


@pytest.mark.parametrize("case", CASES)
def test_every_survivor_raises_naming_the_victim_in_time_and_nothing_is_left(ci_run, case):
    report, stdout = ci_run
    kind, transport = case.split("-")
    trials = [t for t in report["trials"] if t["kind"] == kind and t["transport"] == transport]
    assert trials, f"the --ci plan has no {case} trial"
    for t in trials:
        where = (
            f"{kind} on {transport}, {t['world']} ranks, victim rank {t['victim']}, "
            f"fault during {t.get('op_at_fault')}:\n{json.dumps(t, indent=1)[:6000]}"
        )
        assert "setup_failed" not in t, where
        assert not t["hangs"], f"hang: {where}"
        assert not t["leftovers"], f"leftovers: {where}"
        assert not t.get("early_errors"), f"error before the fault: {where}"
        assert t["survivors"] and len(t["survivors"]) == t["world"] - 1, where
        for s in t["survivors"]:
            assert s["outcome"] in ("named", "wrong"), f"rank {s['rank']} did not raise: {where}"
            assert s["ringcomm_error"], where
            # Named: the victim in the text, and the fault's class (faults.py's ERROR_CLASS:
            # PeerLostError, CollectiveTimeoutError for a stall), which survivors that did not
            # see the fault themselves hear in the abort of one that did. A stall is named
            # through the chain of waiting notices (docs/reliability.md).
            assert s["named"], f"rank {s['rank']}'s error does not name the victim: {where}"
            if kind == "stall":
                assert "Timed out" in s["text"], where
                # not before the deadline (a false alarm), not long after it
                assert t["timeout"] / 2 < s["detect_s"] < t["timeout"] + BOUND_S, where
            else:
                assert 0 <= s["detect_s"] < BOUND_S, where
            assert s.get("close_s", 0) < BOUND_S and "close_error" not in s, where
        if kind.startswith("close"):
            assert t["shutdown"]["sockets"] >= 1, f"no socket was shut down: {where}"


def test_the_bench_summary_reports_no_hang(ci_run):
    report, stdout = ci_run
    assert sum(g["hangs"] for g in report["summary"].values()) == 0, stdout
    assert len(report["trials"]) >= len(CASES), stdout
