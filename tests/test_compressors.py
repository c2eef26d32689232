"""A compressor written in one file, here, against ringcomm.compress.Compressor, runs under DDP
(compressor_hook), under GradientAverager and in bench/compression_quality.py, with its memory
following DDP's rebuilt buckets, its statistics and its whole buckets counted and logged."""

import json
import logging
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm
from ranks import run_ranks
from ringcomm.compress import Compressor, Dense
from ringcomm.hooks import compressor_hook
from test_topk_hook import digits_batches  # tests/ is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))


class Bfloat16Feedback(Compressor):
    """Each bucket as bfloat16, with what the rounding lost added to the next step's gradient;
    whole (float32) on the first `dense_steps` steps."""

    def __init__(self, dense_steps=1):
        super().__init__()
        self.dense_steps = dense_steps

    def compress(self, comm, bucket):
        if self.step < self.dense_steps:
            return Dense(bucket.gradient(), "first steps")
        residual = self.memory.get("residual", bucket, bucket.gradient())
        residual.add_(bucket.gradient())
        wire = residual.to(torch.bfloat16)
        residual.sub_(wire.float())
        return wire

    def exchange(self, comm, bucket, wire):
        return ringcomm.compress.average_densely(comm, wire).get_future()

    def decompress(self, comm, bucket, wire, average):
        return average.float() if bucket.flat is None else average.float().view_as(bucket.flat)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def ddp_run(store, rank, world, steps):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ringcomm").addHandler(handler)
    logging.getLogger("ringcomm").setLevel(logging.INFO)
    model = DDP(make_model(), bucket_cap_mb=1)  # several buckets, rebuilt after step 0
    state = Bfloat16Feedback()
    model.register_comm_hook(state, compressor_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for xb, yb in digits_batches(rank, world, steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buckets = ringcomm.hooks.default_communicator().stats()["buckets"]
    residual_numel = sum(t.numel() for t in state.memory.named("residual").values())
    dist.destroy_process_group()
    return dict(
        losses=losses,
        params=params,
        stats=state.stats,
        step=state.step,
        lines=lines,
        buckets=buckets,
        residual_numel=residual_numel,
    )


def test_a_compressor_of_a_few_lines_trains_under_ddp():
    steps = 12
    results = run_ranks(2, ddp_run, steps, make_comm=False, timeout=180)
    params = sum(p.numel() for p in make_model().parameters())
    for r in results:
        stats = r["stats"]
        assert r["step"] == stats.steps == steps
        # the first step's buckets whole, the rebuilt ones (two or more) compressed after it
        assert stats.dense_reasons == {"first steps": stats.dense_buckets}
        assert stats.compressed_buckets >= 2 * (steps - 1)
        calls = r["buckets"].values()
        assert sum(b["dense"] for b in calls) == stats.dense_buckets
        assert sum(b["calls"] for b in calls) == stats.dense_buckets + stats.compressed_buckets
        assert 1.7 < stats.compression_ratio < 2.1  # bfloat16: half of float32's bytes
        assert r["residual_numel"] == params  # one residual per rebuilt bucket, all parameters
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3])
        assert any("goes whole (first steps) from step 0" in line for line in r["lines"])
        assert any("is compressed from step 1" in line for line in r["lines"])
    assert torch.equal(results[0]["params"], results[1]["params"])


def averager_run(comm, steps):
    torch.manual_seed(comm.rank)
    params = [nn.Parameter(torch.zeros(300)), nn.Parameter(torch.zeros(20, 5))]
    local = [torch.randn_like(p) for p in params]
    state = Bfloat16Feedback(dense_steps=0)
    averager = ringcomm.GradientAverager(params, comm, compression=state)
    sent = [torch.zeros_like(p) for p in params]
    for _ in range(steps):
        for p, g in zip(params, local):
            p.grad = g.clone()
        averager.step()
        for s, p in zip(sent, params):
            s += p.grad
    averager.remove()
    return sent, local, state.stats


def test_a_compressor_of_a_few_lines_runs_under_gradient_averager():
    steps = 5
    results = run_ranks(2, averager_run, steps)
    (sent0, local0, stats), (sent1, local1, _) = results
    assert stats.steps == steps and stats.compressed_buckets == steps
    for s0, s1, a, b in zip(sent0, sent1, local0, local1):
        assert torch.equal(s0, s1)
        # error feedback: what was sent adds up to the true averages but for the last residual
        # and the bfloat16 rounding of each step's average (2**-9 of it, at most)
        true = steps * (a + b) / 2
        assert bool(((s0 - true).abs() <= 2**-8 * (true.abs() + 1)).all())


BENCH = os.path.join(HERE, "..", "bench", "compression_quality.py")


def test_bench_help_lists_the_configurations():
    # The names hold % signs, which argparse's help formatting once choked on.
    run = subprocess.run(
        [sys.executable, BENCH, "--help"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = " ".join(run.stdout.split())  # as argparse wraps it
    assert "topk-10%, topk-0.1%," in text and "topk/ratio=0.001/schedule='fixed'" in text


def test_bench_runs_its_matrix_and_a_compressor_from_a_file(tmp_path):
    # Tiny models for a few steps: the bench's own machinery (forked ranks, per-configuration
    # groups and settings, byte counting, the summary and its checks, JSON, plot).
    out, plot = tmp_path / "quality.json", tmp_path / "quality.svg"
    mine = f"{HERE}/test_compressors.py:Bfloat16Feedback/dense_steps=0"
    configs = [
        "dense",
        "bf16",
        "topk-10%/schedule='fixed'/warmup_steps=0",
        "quantize",
        "powersgd-1/start_iter=2",
        mine,
    ]
    run = subprocess.run(
        [
            sys.executable,
            BENCH,
            "--ranks",
            "2",
            "--steps",
            "4,8",
            "--models",
            "digits,classification",
            "--width",
            "64",
            "--features",
            "128",
            "--evals",
            "2",
            "--configs",
            ",".join(configs),
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and report["machine"] and report["commit"], report.keys()
    records = report["results"]
    labels = [c.replace(f"{HERE}/", "") for c in configs]
    assert len(records) == 2 * 2 * len(configs)  # models x lengths x configurations
    assert [r["config"] for r in records[: len(configs)]] == labels
    for r in records:
        assert not r["error"] and 0 < r["accuracy"] <= 1 and len(r["curve"]) == 2, r
    cell = {r["config"]: r for r in records if r["model"] == "digits" and r["steps"] == 8}
    dense = cell["dense"]["bytes_per_step"]
    assert 1.8 < dense / cell["bf16"]["bytes_per_step"] < 2.2  # half the bytes on the wire
    assert cell["topk-10%/schedule='fixed'/warmup_steps=0"]["bytes_per_step"] < dense / 2
    assert 3 < dense / cell["quantize"]["bytes_per_step"] < 4.2  # a byte per float32
    assert cell["test_compressors.py:Bfloat16Feedback/dense_steps=0"]["compressed_buckets"] > 0
    # the checks the matrix has configurations for: the default quantizer's (no default top-k)
    assert [c["check"] for c in report["checks"]] == [
        "quantize within 1 point of dense in every cell"
    ]
    assert "<svg" in plot.read_text() and "| 8 | dense |" in run.stdout
