"""python -m ringcomm.bench --device cuda: 2 ranks on one GPU over CUDA IPC, beside the device
memory floor and the device path's algorithms forced, every result checked, the JSON naming the
GPU and the transport."""

import json
import subprocess
import sys

import torch


def test_bench_on_one_gpu_with_the_device_memory_floor(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--device",
        "cuda",
        "--ranks",
        "2",
        "--sizes",
        "8,64K,4M",
        "-n",
        "5",
        "-w",
        "1",
        "--repeats",
        "2",
        "--floor",
        "--compare",
        "one_shot,shared_buffer",
        "--json",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "vs floor" in run.stdout and "stream-synchronised" in run.stdout, run.stdout
    data = json.loads(out.read_text())
    assert data["machine"] == torch.cuda.get_device_name(0), data["machine"]
    assert data["transport"] == "cuda_ipc" and data["args"]["device"] == "cuda"
    assert [r["size"] for r in data["rows"]] == [8, 64 << 10, 4 << 20]
    for r in data["rows"]:
        for lib in ("ringcomm", "one_shot", "shared_buffer"):
            assert r[lib]["wrong"] == 0 and len(r[lib]["samples_us"]) == 2, (lib, r)
        assert r["floor"]["wrong"] is None and r["floor"]["time_us"] > 0, r
        assert r["ratios"]["floor"]["time"] == r["ringcomm"]["time_us"] / r["floor"]["time_us"]
