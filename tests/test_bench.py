"""The benchmark CLI runs end to end, checks its results and writes JSON."""
import json
import subprocess
import sys


def test_bench_compares_with_gloo_and_writes_json(tmp_path):
    out_file = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "--ranks", "2", "--sizes", "8,64K,1M",
           "-n", "3", "-w", "1", "--repeats", "2", "--compare", "gloo", "--json", str(out_file)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "busbw" in run.stdout and "time ratio" in run.stdout
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["size"] for r in rows] == [8, 65536, 1 << 20]
    for r in rows:
        assert r["ringcomm"]["wrong"] == 0 and r["gloo"]["wrong"] == 0
        assert r["ringcomm"]["time_us"] > 0 and len(r["ringcomm"]["samples_us"]) == 2


def test_bench_other_collectives_check_results(tmp_path):
    for coll in ("reduce_scatter", "all_gather", "broadcast", "reduce"):
        out_file = tmp_path / f"{coll}.json"
        cmd = [sys.executable, "-m", "ringcomm.bench", "--ranks", "3", "--coll", coll, "-d", "half",
               "--sizes", "96,300K", "-n", "2", "-w", "1", "--repeats", "1", "--json", str(out_file)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        for r in json.loads(out_file.read_text())["rows"]:
            assert r["ringcomm"]["wrong"] == 0, (coll, r)
