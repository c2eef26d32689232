"""The benchmark CLI runs end to end, checks its results and writes JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_bench_floor_row(tmp_path):
    out_file = tmp_path / "floor.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "--ranks", "2", "--sizes", "8,4K", "-n", "3",
           "-w", "1", "--repeats", "2", "--floor", "--json", str(out_file)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "floor time(us)" in run.stdout and "floor time ratio" in run.stdout
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["size"] for r in rows] == [8, 4096]
    for r in rows:
        assert r["floor"]["time_us"] > 0 and len(r["floor"]["samples_us"]) == 2
        assert r["floor"]["wrong"] is None and r["ringcomm"]["wrong"] == 0
        ratio = r["ratios"]["floor"]
        assert abs(ratio["time"] - r["ringcomm"]["time_us"] / r["floor"]["time_us"]) < 1e-9
        assert abs(ratio["busbw"] * ratio["time"] - 1) < 1e-9  # same bytes: busbw ratio = 1 / time ratio


@pytest.mark.parametrize("missing", ["mpi4py", "mpiexec"])
def test_bench_compare_mpi_without_mpi_says_what_to_install(monkeypatch, missing):
    import importlib.util

    from ringcomm import bench

    if missing == "mpiexec":
        monkeypatch.setattr(bench, "find_mpiexec", lambda: None)
    else:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "mpi4py" else find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"pip install 'ringcomm\[mpi\]'"):
        bench.main(["--compare", "gloo,mpi"])


def test_bench_compare_mpi(tmp_path):
    pytest.importorskip("mpi4py")
    out_file = tmp_path / "mpi.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "--ranks", "2", "--sizes", "8,64K", "-n", "3",
           "-w", "1", "--repeats", "2", "--compare", "mpi", "--json", str(out_file)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mpi time(us)" in run.stdout and "mpi time ratio" in run.stdout
    data = json.loads(out_file.read_text())
    assert data["mpi"]["library"]
    assert [r["size"] for r in data["rows"]] == [8, 65536]
    for r in data["rows"]:
        assert r["mpi"]["wrong"] == 0 and r["ringcomm"]["wrong"] == 0
        assert r["mpi"]["time_us"] > 0 and len(r["mpi"]["samples_us"]) == 2
        assert r["ratios"]["mpi"]["time"] > 0


def test_compression_quality_bench_reports_every_configuration(tmp_path):
    # A tiny model for an epoch: the bench's own machinery (spawned ranks, per-configuration
    # groups and settings, byte counting, JSON, plot).
    out, plot = tmp_path / "quality.json", tmp_path / "quality.svg"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "compression_quality.py"), "--ranks", "2",
           "--epochs", "2", "--width", "128", "--configs",
           "dense,bf16,topk-10%/warmup_steps=0,powersgd-1/start_iter=2",
           "--json", str(out), "--plot", str(plot)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["dense", "bf16", "topk-10%/warmup_steps=0", "powersgd-1/start_iter=2"]
    dense = results["dense"]["bytes_per_step"]
    for name in ("dense", "bf16", "topk-10%/warmup_steps=0", "powersgd-1/start_iter=2"):
        r = results[name]
        assert not r["error"] and len(r["accuracy"]) == 2 and 0 < r["accuracy"][-1] <= 1, r
    assert results["dense"]["accuracy"][-1] > 0.5  # it trains
    assert abs(results["bf16"]["accuracy"][-1] - results["dense"]["accuracy"][-1]) < 0.05
    assert 1.8 < dense / results["bf16"]["bytes_per_step"] < 2.2  # half the bytes on the wire
    assert results["topk-10%/warmup_steps=0"]["bytes_per_step"] < dense / 2
    assert "<svg" in plot.read_text() and "| dense |" in run.stdout
