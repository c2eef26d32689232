"""The benchmark CLI runs end to end, checks its results and writes JSON."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_run_metadata(report: dict):
    """Every JSON report of the benchmarks says where, on what code and when it ran."""
    assert "vCPUs" in report["machine"] and report["commit"], report
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", report["date"]), report["date"]


def test_bench_compares_with_gloo_and_forced_algorithms_and_writes_json(tmp_path):
    out_file = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "--sizes",
        "8,64K,1M",
        "-n",
        "3",
        "-w",
        "1",
        "--repeats",
        "2",
        "--compare",
        "gloo,ring,tree",
        "--json",
        str(out_file),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "busbw" in run.stdout and "gloo time ratio" in run.stdout
    assert "ring time ratio" in run.stdout and "tree time ratio" in run.stdout
    data = json.loads(out_file.read_text())
    assert_run_metadata(data)
    rows = data["rows"]
    assert [r["size"] for r in rows] == [8, 65536, 1 << 20]
    for r in rows:
        assert r["algo"] == "auto"
        for lib in ("ringcomm", "gloo", "ring", "tree"):  # forced algorithms are checked too
            assert r[lib]["wrong"] == 0 and len(r[lib]["samples_us"]) == 2, (lib, r)
        for lib in ("gloo", "ring", "tree"):
            assert r["ratios"][lib]["time"] == pytest.approx(
                r["ringcomm"]["time_us"] / r[lib]["time_us"]
            )
        # which algorithm auto ran; where it is a forced column, its time over the fastest one
        assert r["auto_chose"] in ("ring", "tree", "recursive_doubling"), r
        if r["auto_chose"] in ("ring", "tree"):
            fastest = min(r["ring"]["time_us"], r["tree"]["time_us"])
            assert r["chosen_vs_best"] == pytest.approx(r[r["auto_chose"]]["time_us"] / fastest)
        else:
            assert "chosen_vs_best" not in r
    # 8 bytes on 2 ranks: recursive doubling's one round against two of the ring and the tree
    # (RINGCOMM_TUNING=off in tests: alpha 16 us, beta 4 GB/s)
    assert rows[0]["auto_chose"] == "recursive_doubling"
    assert "auto chose" in run.stdout and "chosen / best" in run.stdout
    report = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "report.py"), str(out_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    lines = report.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| size"))
    head, first = lines[at], lines[at + 2]  # the table's head and (after its rule) the 8-byte row
    assert head.endswith("| auto chose | chosen / best |")
    assert first.endswith("| recursive doubling | - |")


def test_bench_other_collectives_check_results(tmp_path):
    for coll in ("reduce_scatter", "all_gather", "broadcast", "reduce"):
        out_file = tmp_path / f"{coll}.json"
        cmd = [
            sys.executable,
            "-m",
            "ringcomm.bench",
            "--ranks",
            "3",
            "--coll",
            coll,
            "-d",
            "half",
            "--sizes",
            "96,300K",
            "-n",
            "2",
            "-w",
            "1",
            "--repeats",
            "1",
            "--json",
            str(out_file),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        for r in json.loads(out_file.read_text())["rows"]:
            assert r["ringcomm"]["wrong"] == 0, (coll, r)


def test_bench_floor_row(tmp_path):
    out_file = tmp_path / "floor.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "--sizes",
        "8,4K",
        "-n",
        "3",
        "-w",
        "1",
        "--repeats",
        "2",
        "--floor",
        "--json",
        str(out_file),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "floor time(us)" in run.stdout and "vs floor" in run.stdout
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["size"] for r in rows] == [8, 4096]
    for r in rows:
        assert r["floor"]["time_us"] > 0 and len(r["floor"]["samples_us"]) == 2
        assert r["floor"]["wrong"] is None and r["ringcomm"]["wrong"] == 0
        ratio = r["ratios"]["floor"]
        assert abs(ratio["time"] - r["ringcomm"]["time_us"] / r["floor"]["time_us"]) < 1e-9
        assert (
            abs(ratio["busbw"] * ratio["time"] - 1) < 1e-9
        )  # same bytes: busbw ratio = 1 / time ratio


def _floor_spans(comm, spans, iters):
    from ringcomm.bench.collectives import all_at_once

    return all_at_once(comm, spans[comm.rank], iters)


def test_a_sample_every_rank_runs_at_once_lasts_from_the_first_start_to_the_last_end():
    """The floor's samples: a rank that starts late (woken last by the barrier, with more ranks
    than cores) makes the sample last longer though its own time is as short as the others'."""
    spans = {
        0: [(10.0, 10.2), (20.0, 20.2)],  # each rank's own time: 0.2 s a sample, 2 calls
        1: [(10.3, 10.5), (19.9, 20.1)],
    }  # sample 1: starts once rank 0 is done
    results = run_ranks(2, _floor_spans, spans, 2)
    for per_call in results:
        assert per_call == pytest.approx([0.25, 0.15])  # (10.5 - 10.0) / 2, (20.2 - 19.9) / 2


@pytest.fixture(scope="module")
def limits_run(tmp_path_factory):
    """One small run with both limits, its JSON and its figure, shared by the tests below."""
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("limits")
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "--sizes",
        "8,64K",
        "-n",
        "5",
        "-w",
        "1",
        "--repeats",
        "2",
        "--floor",
        "--wire",
        "--json",
        str(out / "rows.json"),
        "--plot",
        str(out / "rows.png"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, out


def assert_png(path, min_bytes):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > min_bytes, (path, len(data))


def test_samples_interleave_with_a_different_lead_and_neighbours_each_repeat():
    from ringcomm.bench.collectives import interleaved

    names = ["ringcomm", "ring", "shared_buffer", "floor"]
    order = list(interleaved(names, 6))
    repeats = [order[i : i + 4] for i in range(0, len(order), 4)]
    assert all(sorted(r) == sorted(names) for r in repeats) and len(repeats) == 6
    assert len({r[0] for r in repeats[:4]}) == 4
    # a column's samples follow more than one other column's
    for name in names:
        before = {order[i - 1] for i in range(1, len(order)) if order[i] == name}
        assert len(before) > 1, (name, before)


def test_bench_warms_auto_up_past_its_first_trials(tmp_path):
    """4 calls before the only sample, where auto's first trials take 16: the bench runs auto
    until they are over, so the sample times the winner."""
    out_file = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "--sizes",
        "1M",
        "-n",
        "3",
        "-w",
        "1",
        "--sample-warmup",
        "0",
        "--repeats",
        "1",
        "--compare",
        "ring",
        "--json",
        str(out_file),
    ]
    env = dict(os.environ, RINGCOMM_TRANSPORT="shm", RINGCOMM_RETUNE_CALLS="24")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out_file.read_text())["rows"]
    assert row["auto_trials"]["rounds"] >= 1, row["auto_trials"]  # more after a change
    assert len(row["auto_trials"]["seconds"]) == len(row["auto_trials"]["candidates"]) > 1


def test_bench_plot_writes_a_png(limits_run):
    _, out = limits_run
    assert_png(out / "rows.png", 20_000)  # two panels, three series, a legend


def test_bench_wire_row(limits_run):
    run, out = limits_run
    rate = re.search(r"# wire: .*: ([0-9.]+) GB/s \(([0-9.]+) Gbit/s\)", run.stdout)
    assert rate, run.stdout
    gbytes, gbits = float(rate.group(1)), float(rate.group(2))
    assert gbytes > 0 and abs(gbits - 8 * gbytes) < 0.02 * gbits
    assert "wire time(us)" in run.stdout and "vs wire" in run.stdout
    data = json.loads((out / "rows.json").read_text())
    assert data["wire"]["stream_bytes"] == 16 << 20 and len(data["wire"]["samples_us"]) == 2
    assert abs(data["wire"]["rate_GBps"] - gbytes) < 1e-3
    for r in data["rows"]:
        wire = r["wire"]
        # the bytes on the wire at the measured rate: 2(n-1)/n x size, n = 2
        assert wire["time_us"] > 0 and wire["wrong"] is None
        assert (
            abs(wire["time_us"] * 1e-6 * data["wire"]["rate_GBps"] * 1e9 - r["size"])
            < 1e-6 * r["size"]
        )
        assert abs(wire["busbw"] - data["wire"]["rate_GBps"]) < 1e-9
        assert abs(r["ratios"]["wire"]["time"] - r["ringcomm"]["time_us"] / wire["time_us"]) < 1e-9


def test_bench_wire_and_plot_refuse_what_they_cannot_do():
    from ringcomm.bench import collectives as bench

    with pytest.raises(SystemExit, match="--wire is the link limit of a ring all_reduce"):
        bench.main(["--wire", "--coll", "reduce_scatter"])
    with pytest.raises(SystemExit, match="--wire measures the links between ranks"):
        bench.main(["--wire", "--ranks", "1"])
    with pytest.raises(SystemExit, match="all_reduce_coalesced has one row"):
        bench.main(["--plot", "x.png", "--coll", "all_reduce_coalesced"])
    with pytest.raises(SystemExit, match="--compare nccl times ncclAllReduce"):
        bench.main(["--compare", "nccl", "--coll", "broadcast"])
    with pytest.raises(SystemExit, match="--compare ring,tree forces ringcomm's all_reduce"):
        bench.main(["--compare", "ring,tree", "--coll", "broadcast"])
    if torch.cuda.device_count() < 2:  # this machine: no GPU
        with pytest.raises(SystemExit, match="every rank on a GPU of its own: 2 local ranks"):
            bench.main(["--compare", "nccl", "--ranks", "2"])


def test_bench_device_cuda_refuses_what_it_cannot_do():
    from ringcomm.bench import collectives as bench

    with pytest.raises(SystemExit, match="--device cuda times all_reduce"):
        bench.main(["--device", "cuda", "--coll", "reduce_scatter"])
    with pytest.raises(SystemExit, match="compares with nccl and forced algorithms, not gloo"):
        bench.main(["--device", "cuda", "--compare", "gloo"])
    with pytest.raises(SystemExit, match="compares with nccl and forced algorithms, not wire"):
        bench.main(["--device", "cuda", "--wire"])
    with pytest.raises(SystemExit, match="halving_doubling: not an algorithm of the device path"):
        bench.main(["--device", "cuda", "--compare", "one_shot,halving_doubling"])
    with pytest.raises(SystemExit, match="one_shot is an algorithm of the device path"):
        bench.main(["--algo", "one_shot"])
    if torch.cuda.device_count() == 0:  # this machine: no GPU (tests/gpu/test_bench_cuda.py)
        with pytest.raises(SystemExit, match="--device cuda needs a GPU"):
            bench.main(["--device", "cuda", "--compare", "one_shot,shared_buffer", "--floor"])


def test_bench_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    from ringcomm.bench import collectives as bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import of it finds: none
    with pytest.raises(SystemExit, match=r"pip install 'ringcomm\[plot\]'"):
        bench.main(["--sizes", "8", "--plot", str(tmp_path / "rows.png")])
    assert not (tmp_path / "rows.png").exists()


def test_bench_progress_goes_to_stderr_on_long_sweeps():
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "-b",
        "8",
        "-e",
        "2K",
        "-n",
        "2",
        "-w",
        "0",
        "--repeats",
        "1",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = [8 << i for i in range(9)]  # 8 B .. 2 KiB: more than 8 sizes
    assert [line.split()[0] for line in run.stdout.splitlines() if not line.startswith("#")] == [
        str(s) for s in sizes
    ]
    progress = [line for line in run.stderr.splitlines() if line.startswith("[")]
    assert (
        progress[0] == "[1/9] 8 B ..." and progress[-1] == "[9/9] 2 KiB ..." and len(progress) == 9
    )


def test_bench_progress_shows_a_row_that_takes_long(monkeypatch, capsys):
    import time

    from ringcomm.bench import collectives as bench

    monkeypatch.setattr(bench, "PROGRESS_AFTER_S", 0.05)
    with bench.progress(1, 2, 1 << 20, show=True):
        pass  # a quick row: no line
    with bench.progress(2, 2, 64 << 20, show=True):
        time.sleep(0.5)
    assert capsys.readouterr().err == "[2/2] 64 MiB ...\n"


def test_report_prints_the_tables(limits_run):
    _, out = limits_run
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "report.py"),
        str(out / "rows.json"),
        os.path.join(ROOT, "tests", "fixtures", "shm_2ranks.json"),
        "--plot",
        str(out / "report.png"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    tables = run.stdout.split("### ")[1:]
    assert len(tables) == 2
    assert tables[0].startswith("all_reduce, 2 ranks, float sum, shm")
    rows = [line for line in tables[0].splitlines() if line.startswith("| ")]
    assert rows[0] == (
        "| size | ringcomm (us) | memory floor (us) | wire (us) | vs floor | vs wire | #wrong |"
    )
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| 8 B", "| 64 KiB"]
    assert all(r.endswith(" | 0 |") for r in rows[1:])
    # a file from before the bench recorded the transport (tests/fixtures)
    assert "transport not recorded" in tables[1]
    assert "| 8 B | 2.3 | 288.8 | 1.5 | 1.3 | 0.008 | 1.54 | 1.84 | 0 |" in tables[1]
    assert len([line for line in tables[1].splitlines() if line.startswith("| ")]) == 1 + 6
    for name in ("report-rows.png", "report-shm_2ranks.png"):
        assert_png(out / name, 20_000)


def test_timeline_plot_draws_a_trace(tmp_path):
    pytest.importorskip("matplotlib")
    from ringcomm.bench.plot import timeline_plot

    def event(name, ts, dur, pid, tid):
        return {
            "ph": "X",
            "name": name,
            "cat": "ringcomm",
            "ts": ts,
            "dur": dur,
            "pid": pid,
            "tid": tid,
            "args": {"bytes": 65536},
        }

    trace = {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "progress"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank 1"}},
            event("all_reduce", 1000, 900, 0, 7),
            event("reduce_scatter", 1050, 400, 0, 7),  # nested twice: inside all_reduce...
            event("recv", 1100, 100, 0, 7),  # ...and inside reduce_scatter
            event("all_gather", 1460, 400, 0, 7),
            event("all_reduce", 1020, 950, 1, 7),
            event("barrier", 2500, 30, 1, 8),  # a thread without a name
        ]
    }
    timeline_plot(trace, str(tmp_path / "timeline.png"))
    assert_png(tmp_path / "timeline.png", 10_000)
    with pytest.raises(ValueError, match="no complete"):
        timeline_plot({"traceEvents": trace["traceEvents"][:3]}, str(tmp_path / "empty.png"))


@pytest.mark.parametrize("missing", ["mpi4py", "mpiexec"])
def test_bench_compare_mpi_without_mpi_says_what_to_install(monkeypatch, missing):
    import importlib.util

    from ringcomm.bench import collectives as bench

    if missing == "mpiexec":
        monkeypatch.setattr(bench, "find_mpiexec", lambda: None)
    else:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name == "mpi4py" else find_spec(name, *a),
        )
    with pytest.raises(SystemExit, match=r"pip install 'ringcomm\[mpi\]'"):
        bench.main(["--compare", "gloo,mpi"])


@pytest.mark.serial  # Open MPI's segments in /dev/shm: not beside the tests that check it
def test_bench_compare_mpi(tmp_path):
    pytest.importorskip("mpi4py")
    out_file = tmp_path / "mpi.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "2",
        "--sizes",
        "8,64K",
        "-n",
        "3",
        "-w",
        "1",
        "--repeats",
        "2",
        "--compare",
        "mpi",
        "--json",
        str(out_file),
    ]
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


def test_kernel_bench_pack_compares_memory_layouts(tmp_path, capsys):
    from ringcomm.bench import kernels

    out = tmp_path / "pack.json"
    kernels.main(
        [
            "pack",
            "--tensors",
            "200",
            "--tensor-bytes",
            "1K-4K",
            "--repeats",
            "3",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    for layout in ("spread", "spread, by address", "views of one buffer", "one buffer"):
        assert re.search(rf"^  {layout} +[0-9.]+ +[0-9.]+ +[0-9.]+$", printed, re.M), printed
    report = json.loads(out.read_text())
    assert_run_metadata(report)
    assert report["tensors"] == 200 and len(report["samples_us"]["spread"]) == 3
    assert all(t > 0 for t in report["time_us"].values())


def test_gpu_check_dry_run_names_every_step_and_writes_one_report(tmp_path):
    script = os.path.join(ROOT, "bench", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    run = subprocess.run(
        [script, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.log"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["date"] and report["commit"]
    steps = [s["step"] for s in report["steps"]]
    assert steps == [
        "build",
        "kernels can run",
        "tests/gpu time-sliced",
        "tests/gpu mps",
        "bench 2 ranks time-sliced",
        "bench 4 ranks time-sliced",
        "ddp hooks 2 ranks",
        "bench 2 ranks mps",
        "bench 4 ranks mps",
    ], steps
    assert all(s["status"] == "not run (dry run)" for s in report["steps"])
    assert "RINGCOMM_CUDA_ARCHS=90-real" in report["steps"][0]["command"]
    assert "--device cuda -b 8 -e 64M" in report["steps"][4]["command"]
    assert "# GPU check:" in run.stdout and "report:" in run.stdout


def test_ddp_hooks_bench_times_each_hook_against_local_and_counts_staging(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "ddp_hooks.py"), "--device", "cpu"]
    cmd += ["--ranks", "2", "--params", "0.05", "--steps", "3", "--warmup", "1"]
    cmd += ["--hooks", "allreduce,topk", "--timeout", "120", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["hook"] for r in report["rows"]] == ["local", "allreduce", "topk"]
    for row in report["rows"]:
        assert row["step_ms"] > 0 and row["staged_bytes"] == 0, row
        assert row["over_local"] == pytest.approx(row["step_ms"] / report["rows"][0]["step_ms"])
    assert report["device"] == "cpu"
    assert_run_metadata(report)
