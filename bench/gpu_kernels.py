"""ringcomm's CUDA kernels against torch on one GPU, with the memory-bandwidth floor measured in
the same run. CUDA-event timings, medians over --repeat runs after a warm-up.

    python bench/gpu_kernels.py [--repeat 20] [--json FILE]

Rows:
- top-k of 25M float32 at k = 1%: ringcomm.cuda.topk against torch.topk(x.abs(), k) (the same
  selection by magnitude; sorted=False, torch's fastest) and the floor of reading the input once.
- top-k with error feedback: ringcomm's fused kernel against the torch sequence it replaces
  (residual += grad; topk of |residual|; gather; zero the winners).
- reduce (sum) of 256 MiB float32 and bfloat16: against torch.add(out=) and the floor of reading
  two buffers and writing one at the device-to-device copy rate.
- pack of 1000 float32 tensors of 1-16 KiB into one bf16 buffer, scaled: against torch.cat + to.
Prints a markdown table (paste into docs/performance.md) and writes JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import ringcomm.cuda as rc_cuda


def time_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_rate(repeat: int) -> float:
    """Device-to-device copy rate in bytes/s (read + write counted), the floor's yardstick."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeat)
    return 2 * src.numel() / (ms / 1e3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    ok, reason = rc_cuda.status()
    if not ok:
        print(f"gpu_kernels: cannot run: {reason}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rate = copy_rate(args.repeat)
    floor_ms = lambda nbytes: nbytes / rate * 1e3  # noqa: E731
    rows = []

    def row(name, ours, anchor_name, anchor, floor):
        rows.append({"kernel": name, "ringcomm_ms": ours, "anchor": anchor_name,
                     "anchor_ms": anchor, "floor_ms": floor, "speedup": anchor / ours,
                     "vs_floor": ours / floor})

    n = 25_000_000
    k = n // 100
    x = torch.randn(n, device="cuda")
    row("topk float32 25M k=1%", time_ms(lambda: rc_cuda.topk(x, k), args.repeat),
        "torch.topk(x.abs(), sorted=False)",
        time_ms(lambda: torch.topk(x.abs(), k, sorted=False), args.repeat), floor_ms(4 * n))

    grad = torch.randn(n, device="cuda")
    residual = torch.zeros(n, device="cuda")
    torch_residual = torch.zeros(n, device="cuda")

    def torch_step():
        torch_residual.add_(grad)
        idx = torch.topk(torch_residual.abs(), k, sorted=False).indices
        values = torch_residual[idx]
        torch_residual[idx] = 0
        return values, idx

    row("topk_with_residual float32 25M k=1%",
        time_ms(lambda: rc_cuda.topk_with_residual(grad, residual, k), args.repeat),
        "add_ + topk + gather + zero", time_ms(torch_step, args.repeat), floor_ms(4 * n * 3))

    for dtype in (torch.float32, torch.bfloat16):
        count = (256 << 20) // torch.tensor([], dtype=dtype).element_size()
        a = torch.randn(count, device="cuda").to(dtype)
        b = torch.randn(count, device="cuda").to(dtype)
        out = torch.empty_like(a)
        row(f"reduce sum {dtype} 256 MiB", time_ms(lambda: rc_cuda.reduce_(out, a, b), args.repeat),
            "torch.add(out=)", time_ms(lambda: torch.add(a, b, out=out), args.repeat),
            floor_ms(3 * (256 << 20)))

    sizes = torch.randint(256, 4096, (1000,)).tolist()
    tensors = [torch.randn(s, device="cuda") for s in sizes]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device="cuda")
    row("pack 1000 tensors -> bf16, scaled",
        time_ms(lambda: rc_cuda.pack(tensors, dtype=torch.bfloat16, scale=0.5, out=flat), args.repeat),
        "torch.cat + mul + to", time_ms(lambda: (torch.cat(tensors) * 0.5).to(torch.bfloat16), args.repeat),
        floor_ms(sum(sizes) * 6))

    device = torch.cuda.get_device_name()
    print(f"device: {device}; copy rate {rate / 1e9:.0f} GB/s (read + write); "
          f"median of {args.repeat} runs\n")
    print("| kernel | ringcomm (ms) | anchor | anchor (ms) | speed-up | floor (ms) | vs floor |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['ringcomm_ms']:.3f} | {r['anchor']} | {r['anchor_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['floor_ms']:.3f} | {r['vs_floor']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "copy_rate": rate, "repeat": args.repeat, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
