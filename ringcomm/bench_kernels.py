"""Single-process kernel benchmarks, side by side with torch, same input, same run.

    python -m ringcomm.bench_kernels topk --numel 25M --ratio 0.01

topk: ringcomm.compress.topk and the fused topk_with_residual against torch.topk on |x| (the
magnitude selection the compressor needs) and on x itself, on one thread, medians of --repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from . import compress
from .bench import parse_size


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, allocator
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_topk(args):
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=gen, dtype=torch.float32).to(getattr(torch, args.dtype))
    k = max(1, int(args.numel * args.ratio))
    residual = torch.zeros_like(x)
    cases = {
        "ringcomm topk": lambda: compress.topk(x, k),
        "ringcomm topk_with_residual": lambda: compress.topk_with_residual(x, residual, k),
        "torch.topk(x.abs())": lambda: torch.topk(x.abs(), k),
        "torch.topk(x)": lambda: torch.topk(x, k),
    }
    times = {name: median_time(fn, args.repeats) for name, fn in cases.items()}
    # exactness on this very input: the same set as torch's (random floats: no ties at the cut)
    _, ours = compress.topk(x, k)
    _, theirs = torch.topk(x.abs(), k)
    same = set(ours.tolist()) == set(theirs.tolist())
    anchor = times["torch.topk(x.abs())"]
    print(f"# top-k of {args.numel} {args.dtype}, k = {k} ({args.ratio:g}), {args.threads} thread(s), "
          f"median of {args.repeats}; same index set as torch: {same}")
    print(f"# {'kernel':<30} {'time(ms)':>10} {'speedup vs torch.topk(|x|)':>28}")
    for name, t in times.items():
        print(f"  {name:<30} {t * 1e3:>10.2f} {anchor / t:>28.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "k": k, "same_set": same,
                       "times_ms": {n: t * 1e3 for n, t in times.items()}}, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ringcomm.bench_kernels")
    p.add_argument("kernel", choices=["topk"])
    p.add_argument("--numel", type=parse_size, default=25_000_000)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    bench_topk(args)


if __name__ == "__main__":
    main()
