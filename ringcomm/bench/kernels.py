"""Single-process kernel benchmarks, side by side with torch, same input, same run.

    python -m ringcomm.bench.kernels topk --numel 25M --ratio 0.01
    python -m ringcomm.bench.kernels pack --repeats 31
    python -m ringcomm.bench.kernels gpu [--json FILE]

topk: ringcomm.compress.topk and the fused topk_with_residual against torch.topk on |x| (the
magnitude selection the compressor needs) and on x itself, on one thread, medians of --repeats.

pack: the memory layout's cost in a coalesced collective. ringcomm's pack and unpack kernels
(the passes all_reduce_coalesced makes over the caller's tensors) on --tensors float32 tensors
of --tensor-bytes (seed 0), out of cache (a 64 MiB copy between samples), one thread:
- spread: each tensor allocated between temporaries, as `python -m ringcomm.bench --coll
  all_reduce_coalesced` makes them, so they lie apart on the heap, out of order: the heap
  hands back freed temporaries, and about two in five tensors lie below the one before;
- spread, by address: the same tensors walked in the order they lie in memory, which
  separates the cost of the walk's order from that of the tensors' placement;
- views of one buffer: the same sizes back to back;
- one buffer: a single piece of the same bytes (no per-tensor work at all).
Each sample packs every tensor into one staging buffer and unpacks it back.

gpu: ringcomm's CUDA kernels (ringcomm.cuda) against torch on one GPU, with the floor of the
memory traffic each must do at the device-to-device copy rate measured in the same run;
CUDA-event timings, medians of --repeats after a warm-up:
- top-k of --numel float32 at --ratio: against torch.topk(x.abs(), k, sorted=False);
- top-k with error feedback: the fused kernel against the torch sequence it replaces
  (residual += grad, top-k of |residual|, gather, zero the winners);
- reduce (sum) of 256 MiB float32 and bfloat16: against torch.add(out=);
- pack of 1000 float32 tensors of 1-16 KiB into one scaled bf16 buffer: against torch.cat.
bench/gpu_check.sh runs it with the GPU tests and keeps the report.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from .. import _C, backend, compress, fusion
from .. import cuda as rc_cuda
from .._buffers import TORCH_DTYPES
from .common import parse_size, run_metadata


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
    print(
        f"# top-k of {args.numel} {args.dtype}, k = {k} ({args.ratio:g}), {args.threads} thread(s), "
        f"median of {args.repeats}; same index set as torch: {same}"
    )
    print(f"# {'kernel':<30} {'time(ms)':>10} {'speedup vs torch.topk(|x|)':>28}")
    for name, t in times.items():
        print(f"  {name:<30} {t * 1e3:>10.2f} {anchor / t:>28.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **run_metadata(),
                    "args": vars(args),
                    "k": k,
                    "same_set": same,
                    "times_ms": {n: t * 1e3 for n, t in times.items()},
                },
                f,
                indent=1,
            )


def bench_pack(args):
    torch.set_num_threads(1)
    f32 = TORCH_DTYPES[torch.float32]
    lo, hi = (parse_size(s) for s in args.tensor_bytes.split("-"))
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(max(1, lo // 4), hi // 4 + 1, (args.tensors,), generator=gen).tolist()
    spread = [(torch.arange(c, dtype=torch.float64) % 5 + 1).float() for c in counts]
    one = torch.cat(spread)
    views = list(torch.empty_like(one).split(counts))
    staging, evict = torch.empty_like(one), torch.empty(16 << 20)
    total = one.numel()

    def pack_unpack(tensors):
        ptrs, sizes = [t.data_ptr() for t in tensors], [t.numel() for t in tensors]

        def run():
            _C.pack_kernel(f32, ptrs, sizes, 0, total, staging.data_ptr(), f32, 0, 1.0)
            _C.unpack_kernel(staging.data_ptr(), f32, f32, ptrs, sizes, 0, total, 0, 1.0)

        return run

    by_address = sorted(spread, key=lambda t: t.data_ptr())
    cases = {
        "spread": pack_unpack(spread),
        "spread, by address": pack_unpack(by_address),
        "views of one buffer": pack_unpack(views),
        "one buffer": pack_unpack([one]),
    }
    samples = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, each out of cache
        for name, run in cases.items():
            evict.add_(1)
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    times = {name: statistics.median(v) for name, v in samples.items()}
    print(
        f"# pack + unpack of {len(counts)} float32 tensors of {args.tensor_bytes} B "
        f"({4 * total} B), out of cache, 1 thread, median of {args.repeats}"
    )
    print(f"# {'layout':<24} {'time(us)':>10} {'GB/s':>7} {'/ one buffer':>13}")
    for name, t in times.items():
        print(
            f"  {name:<24} {t * 1e6:>10.1f} {2 * 4 * total / t / 1e9:>7.2f} "
            f"{t / times['one buffer']:>13.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **run_metadata(),
                    "tensors": len(counts),
                    "tensor_bytes": args.tensor_bytes,
                    "bytes": 4 * total,
                    "time_us": {k: v * 1e6 for k, v in times.items()},
                    "samples_us": {k: [x * 1e6 for x in v] for k, v in samples.items()},
                },
                f,
                indent=1,
            )


def gpu_time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_rate(repeats: int) -> float:
    """Bytes per second a device-to-device copy of 256 MiB reads and writes."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (gpu_time_ms(functools.partial(dst.copy_, src), repeats) / 1e3)


def bench_gpu(args):
    ok, reason = rc_cuda.status()
    if not ok:
        raise SystemExit(f"ringcomm.bench.kernels gpu: cannot run: {reason}")
    repeats = args.repeats
    rate = copy_rate(repeats)

    def floor_ms(nbytes):
        return nbytes / rate * 1e3

    rows = []

    def row(name, ours, anchor_name, anchor, floor):
        rows.append(
            {
                "kernel": name,
                "ringcomm_ms": ours,
                "anchor": anchor_name,
                "anchor_ms": anchor,
                "speedup": anchor / ours,
                "floor_ms": floor,
                "vs_floor": ours / floor,
            }
        )

    n, k = args.numel, max(1, int(args.numel * args.ratio))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=gen)
    _, ours = rc_cuda.topk(x, k)
    same = torch.equal(ours.long(), torch.topk(x.abs(), k, sorted=False).indices.sort().values)
    row(
        f"topk float32 {n} k={k}",
        gpu_time_ms(lambda: rc_cuda.topk(x, k), repeats),
        "torch.topk(x.abs(), sorted=False)",
        gpu_time_ms(lambda: torch.topk(x.abs(), k, sorted=False), repeats),
        floor_ms(4 * n),
    )
    grad, residual, theirs = x, torch.zeros_like(x), torch.zeros_like(x)

    def torch_step():
        theirs.add_(grad)
        index = torch.topk(theirs.abs(), k, sorted=False).indices
        values = theirs[index]
        theirs[index] = 0
        return values, index

    row(
        f"topk_with_residual float32 {n} k={k}",
        gpu_time_ms(lambda: rc_cuda.topk_with_residual(grad, residual, k), repeats),
        "add_ + topk + gather + zero",
        gpu_time_ms(torch_step, repeats),
        floor_ms(12 * n),
    )
    for dtype in (torch.float32, torch.bfloat16):
        count = (256 << 20) // torch.empty(0, dtype=dtype).element_size()
        a = torch.randn(count, device="cuda", generator=gen).to(dtype)
        b = torch.randn(count, device="cuda", generator=gen).to(dtype)
        out = torch.empty_like(a)
        row(
            f"reduce sum {str(dtype).removeprefix('torch.')} 256 MiB",
            gpu_time_ms(functools.partial(rc_cuda.reduce_, out, a, b), repeats),
            "torch.add(out=)",
            gpu_time_ms(functools.partial(torch.add, a, b, out=out), repeats),
            floor_ms(3 * (256 << 20)),
        )
    sizes = torch.randint(256, 4096, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    tensors = [torch.randn(s, device="cuda", generator=gen) for s in sizes]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device="cuda")
    # The list is read in C++ by the torch module (built here if need be), as wherever it is
    # built; the second row reads it in Python, the path without the module.
    anchor = gpu_time_ms(lambda: (torch.cat(tensors) * 0.5).to(torch.bfloat16), repeats)

    def pack_row(reader, name):
        fusion.torch_module = lambda: reader
        row(
            f"pack 1000 float32 tensors -> bf16, scaled{name}",
            gpu_time_ms(
                lambda: rc_cuda.pack(tensors, dtype=torch.bfloat16, scale=0.5, out=flat), repeats
            ),
            "(torch.cat * 0.5).to(bf16)",
            anchor,
            floor_ms(6 * sum(sizes)),
        )

    torch_module = fusion.torch_module
    try:
        pack_row(backend.load(), "")
        pack_row(None, ", list read in Python")
    finally:
        fusion.torch_module = torch_module
    device = torch.cuda.get_device_name()
    print(
        f"# {device}, torch {torch.__version__}; copy rate {rate / 1e9:.0f} GB/s (read + write); "
        f"median of {repeats}; top-k index set equal to torch's: {same}"
    )
    print("| kernel | ringcomm (ms) | anchor | anchor (ms) | speed-up | floor (ms) | vs floor |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['ringcomm_ms']:.3f} | {r['anchor']} | {r['anchor_ms']:.3f} | "
            f"{r['speedup']:.2f}x | {r['floor_ms']:.3f} | {r['vs_floor']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **run_metadata(device),
                    "device": device,
                    "torch": torch.__version__,
                    "copy_rate": rate,
                    "same_set": same,
                    "rows": rows,
                },
                f,
                indent=1,
            )


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ringcomm.bench.kernels")
    p.add_argument("kernel", choices=["topk", "pack", "gpu"])
    p.add_argument("--numel", type=parse_size, default=25_000_000)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tensors", type=int, default=1000, help="pack: number of tensors")
    p.add_argument("--tensor-bytes", default="1K-16K", help="pack: each tensor's size range")
    p.add_argument("--json")
    args = p.parse_args(argv)
    {"gpu": bench_gpu, "pack": bench_pack, "topk": bench_topk}[args.kernel](args)


if __name__ == "__main__":
    main()
