"""bench/reliability/soak.py in small: 4 ranks, 300 random collectives (the same seeded sequence on every rank),
every result checked bitwise, fds watched. RSS only for a gross leak (64 MB from half-way): a few
hundred steps are mostly the allocator's warm-up, and its noise is several MB (the leak check
proper, under 10 MB, is the benchmark's default 10,000 steps)."""

import json
import os
import subprocess
import sys

SOAK = os.path.join(os.path.dirname(__file__), "..", "bench", "reliability", "soak.py")


def test_soak_four_ranks(tmp_path):
    summary = tmp_path / "soak.json"
    out = subprocess.run(
        [
            sys.executable,
            SOAK,
            "--ranks",
            "4",
            "--steps",
            "300",
            "--warmup",
            "0.5",
            "--sample-every",
            "100",
            "--max-rss-growth",
            "64",
            "--timeout",
            "60",
            "--deadline",
            "150",
            "--json",
            str(summary),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("PASS"), out.stdout[-3000:]
    result = json.loads(summary.read_text())
    assert result["steps"] == 300 and result["wrong"] == 0 and result["fd_growth"] == 0
    assert sum(o["calls"] for o in result["ops"].values()) == 300
    assert all(o["calls"] > 0 for o in result["ops"].values()), result["ops"]  # every collective
    assert [p["samples"][-1][0] for p in result["per_rank"]] == [300] * 4
