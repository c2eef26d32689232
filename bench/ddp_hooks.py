"""DDP's step time with each of ringcomm's hooks against a hook that does not communicate, the
ranks on one device, over the "ringcomm" process group (its device path for CUDA tensors): how
much of a step the averaging costs, and whether any gradient byte crossed to the host.

    python bench/ddp_hooks.py --device cuda --ranks 2 --json ddp.json   # ranks share GPU 0
    python bench/ddp_hooks.py --device cpu --ranks 2 --params 1          # the same on the CPU

Each rank trains an MLP of about --params million float32 parameters on random batches with
SGD; per hook, --warmup steps, then --steps steps timed one by one (on CUDA each ends with a
synchronisation of the device), medians per rank, and of those the slowest rank's. "local"
returns each rank's own gradient (no communication): its step is the floor of the others', and
each hook's row gives its step over local's. `staged_bytes` is what ringcomm staged through host
memory during the timed steps (ringcomm.staging.bytes_to_host()).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOOKS = ("local", "allreduce", "bf16", "topk")


def local_hook(state, bucket):
    """No communication: each rank keeps its own gradient."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_hook(name: str):
    import ringcomm.hooks as hooks

    group = dist.group.WORLD
    if name == "local":
        return None, local_hook
    if name == "allreduce":
        return group, hooks.allreduce_hook
    if name == "bf16":
        return group, hooks.bf16_compress_hook
    if name == "topk":
        return hooks.TopKState(comm=group), hooks.topk_hook
    raise ValueError(f"unknown hook {name!r}; expected one of {', '.join(HOOKS)}")


def model(params_m: float, device: torch.device) -> torch.nn.Module:
    """Four square layers holding about params_m million parameters."""
    width = max(16, int((params_m * 1e6 / 4) ** 0.5))
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


def rank_main(rank: int, args, port: int, results):
    import ringcomm  # noqa: F401 - registers the backend
    from ringcomm import staging

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, args.ranks, rank == 0, timedelta(seconds=120))
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=args.ranks)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = {}
    for name in args.hooks:
        net = model(args.params, device)
        width = net[0].in_features
        ddp = torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None
        )
        state, hook = make_hook(name)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        gen = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(args.batch, width, device=device, generator=gen)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                sync()
                staged_before = staging.bytes_to_host()
            start = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            sync()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        out[name] = {
            "step_ms": 1e3 * statistics.median(times),
            "staged_bytes": staging.bytes_to_host() - staged_before,
        }
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, out))


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--params", type=float, default=25.0, help="million parameters")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--hooks", default=",".join(HOOKS), help=f"from {', '.join(HOOKS)}")
    p.add_argument("--timeout", type=float, default=300, help="seconds before the ranks are killed")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.hooks = [h for h in args.hooks.split(",") if h]
    if "local" not in args.hooks:
        args.hooks.insert(0, "local")
    for name in args.hooks:
        if name not in HOOKS:
            p.error(f"unknown hook {name!r}; expected some of {', '.join(HOOKS)}")

    from ringcomm.bench.common import free_port, run_metadata

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args, port, results)) for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [proc for proc in procs if proc.is_alive()]
    for proc in hung:
        proc.kill()
    if hung or any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(
            f"ddp_hooks: {len(hung)} ranks hung past {args.timeout:.0f} s, exit codes "
            f"{[proc.exitcode for proc in procs]}"
        )
    per_rank = dict(results.get() for _ in procs)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    rows = []
    for name in args.hooks:
        step = max(per_rank[r][name]["step_ms"] for r in per_rank)
        staged = sum(per_rank[r][name]["staged_bytes"] for r in per_rank)
        rows.append({"hook": name, "step_ms": step, "staged_bytes": staged})
    local = rows[0]["step_ms"]
    for row in rows:
        row["over_local"] = row["step_ms"] / local
    print(
        f"DDP, {args.ranks} ranks on one {args.device} device ({gpu or 'CPU'}), "
        f"{args.params:g}M parameters, batch {args.batch}; medians of {args.steps} steps"
    )
    print(f"{'hook':<10} {'step (ms)':>10} {'/ local':>8} {'staged bytes':>13}")
    for row in rows:
        print(
            f"{row['hook']:<10} {row['step_ms']:>10.2f} {row['over_local']:>8.2f} "
            f"{row['staged_bytes']:>13}"
        )
    if args.json:
        report = {
            **run_metadata(gpu),
            "command": " ".join(sys.argv),
            "device": args.device,
            "ranks": args.ranks,
            "params_m": args.params,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
