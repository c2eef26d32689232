"""Accuracy against bytes sent, for every gradient compression, on the same model in the same run.

    python bench/compression_quality.py --ranks 4 --epochs 10
    python bench/compression_quality.py --ranks 8 --epochs 30 --configs dense,topk-1% \
        --report-epochs 5,10,30 --json bench/results/compression_quality_8ranks_epyc-2vcpu.json \
        --plot quality_8ranks.svg

Forks --ranks processes on this host, joined by a gloo process group. Each configuration trains
the MLP of examples/train_ddp.py (64-W-W-10, W = --width) on scikit-learn's digits with DDP over
gloo, from the same initial weights, on the same batches, with SGD (lr 0.05, momentum 0.9), one
configuration after the other, and rank 0 measures test accuracy after every epoch. The gradients
are averaged by DDP's own gloo all-reduce ("dense") or by a ringcomm comm hook; "torch-powersgd"
is torch's own PowerSGD hook, for comparison. Bytes are what every rank sent, over TCP (all of
the process's sockets) and through ringcomm's shared memory, summed over ranks, per step. Each
configuration gets its own gloo group with a short timeout, so one that fails is reported as
failed and the others still run; torch's own hooks run in processes of their own, since its
PowerSGD hook on gloo can abort the process.
"""
import argparse
import ast
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_ddp  # noqa: E402  (the model, the data split and the byte counters)

import ringcomm  # noqa: E402,F401  (registers the backend)
from ringcomm import hooks  # noqa: E402


def topk(ratio, **settings):
    return lambda: (hooks.TopKState(ratio=ratio, **settings), hooks.topk_hook)


def powersgd(rank):
    return lambda: (hooks.PowerSGDState(matrix_approximation_rank=rank), hooks.powersgd_hook)


def torch_powersgd(rank):
    def make():
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook
        return (torch_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                         start_powerSGD_iter=10), torch_hook.powerSGD_hook)
    return make


# name -> () -> (hook state, hook), or None for DDP's own all-reduce
CONFIGS = {
    "dense": None,
    "fp16": lambda: (None, hooks.fp16_compress_hook),
    "bf16": lambda: (None, hooks.bf16_compress_hook),
    "topk-10%": topk(0.1),
    "topk-1%": topk(0.01),
    "topk-0.1%": topk(0.001),
    # the defaults before the sparsity warm-up: 10 dense steps, then 1% at once, float32 values
    "topk-1%-abrupt": topk(0.01, dense_steps=10, warmup_steps=0, value_dtype=torch.float32,
                           adaptive=False),
    "topk-1%-dgc": topk(0.01),  # with take_momentum(optimizer): see Run
    "powersgd-1": powersgd(1),
    "powersgd-2": powersgd(2),
    "powersgd-4": powersgd(4),
    "torch-powersgd-4": torch_powersgd(4),
}
DEFAULT_CONFIGS = ("dense,fp16,bf16,topk-10%,topk-1%,topk-0.1%,topk-1%-abrupt,powersgd-1,"
                   "powersgd-2,powersgd-4,torch-powersgd-4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   # argparse formats help with %: the names' own % signs are doubled
                   help=f"comma-separated, from: {', '.join(CONFIGS).replace('%', '%%')}; a "
                        f"configuration may change its state's settings: "
                        f"topk-1%%/warmup_steps=10/adaptive=False")
    p.add_argument("--report-epochs", default="",
                   help="epochs whose test accuracy goes in the table too (default: the last)")
    p.add_argument("--group-timeout", type=float, default=120,
                   help="seconds before a configuration's stuck collective fails it")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--plot", help="write an SVG of accuracy against bytes sent here")
    args = p.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c.split("/")[0] not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    args.report_epochs = sorted({int(e) for e in args.report_epochs.split(",") if e} |
                                {args.epochs})
    if args.batch_size % args.ranks or args.report_epochs[0] < 1 or \
            args.report_epochs[-1] > args.epochs:
        p.error("--batch-size must be a multiple of --ranks; --report-epochs within 1..--epochs")
    return args


def train(args, name, group, rank, world, data):
    """Trains one configuration; returns its accuracy per epoch (rank 0), bytes and step time."""
    train_x, train_y, test_x, test_y = data
    model = DDP(train_ddp.mlp(args.width, args.seed), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    base, *overrides = name.split("/")  # e.g. topk-1%/warmup_steps=10/value_dtype=float32
    make = CONFIGS[base]
    if make is not None:
        state, hook = make()
        for setting in overrides:
            key, value = setting.split("=")
            current = getattr(state, key)
            setattr(state, key, getattr(torch, value) if isinstance(current, torch.dtype)
                    else ast.literal_eval(value))
        if overrides:
            state.__post_init__()
        if name.endswith("-dgc"):
            state.take_momentum(optimizer)
        model.register_comm_hook(state, hook)
    per_rank = args.batch_size // world
    steps_per_epoch = len(train_y) // args.batch_size
    accuracy, seconds, sent = [], 0.0, 0
    for epoch in range(args.epochs):
        shuffle = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        order = torch.randperm(len(train_y), generator=shuffle)
        for i in range(steps_per_epoch):
            batch = order[i * args.batch_size + rank * per_rank:][:per_rank]
            before, start = train_ddp.bytes_sent(), time.perf_counter()
            loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds += time.perf_counter() - start
            sent += train_ddp.bytes_sent() - before
        if rank == 0:
            with torch.no_grad():
                accuracy.append((model.module(test_x).argmax(1) == test_y).float().mean().item())
    steps = steps_per_epoch * args.epochs
    del model  # before its group goes (see examples/train_ddp.py)
    return dict(accuracy=accuracy, bytes_per_step=sent / steps, step_ms=1e3 * seconds / steps)


def worker(rank, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.ranks), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    # The hooks' communicator, made now: made by the first hook call, its setup (the link probe
    # sends MBs) counted as the first ringcomm configuration's bytes (bf16 at 2 ranks, width 128:
    # 13 MB a step instead of 0.1).
    hooks.default_communicator()
    data = train_ddp.digits(args.seed)
    results = {}
    for name in args.configs:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.group_timeout))
        try:
            result = train(args, name, group, rank, args.ranks, data)
            error = ""
        except Exception as e:  # reported, and the next configuration runs
            result, error = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if os.environ.get("QUALITY_TRACEBACK"):
                traceback.print_exc()
        # every rank learns whether any failed, and the sum of bytes (on the default group)
        totals = torch.tensor([float(bool(error)), result.get("bytes_per_step", 0.0),
                               result.get("step_ms", 0.0)], dtype=torch.float64)
        dist.all_reduce(totals)
        if rank == 0:
            failed = int(totals[0])
            results[name] = dict(result, error=error or (f"failed on {failed} other rank(s)"
                                                         if failed else ""),
                                 bytes_per_step=totals[1].item(),
                                 step_ms=totals[2].item() / args.ranks)
            print(f"  {name}: {row_text(results[name], args)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def row_text(r, args):
    if r["error"]:
        return f"failed: {r['error']}"
    acc = "  ".join(f"ep{e} {100 * r['accuracy'][e - 1]:6.2f}%" for e in args.report_epochs)
    return f"{acc}  {r['bytes_per_step'] / 1e6:8.3f} MB/step  {r['step_ms']:7.1f} ms/step"


def table(results, args) -> str:
    dense = results.get("dense")
    head = "| configuration | " + " | ".join(f"accuracy, epoch {e}" for e in args.report_epochs)
    head += " | MB sent per step (all ranks) | dense bytes / these | step (ms) |"
    lines = [head, "|---|" + "---:|" * (len(args.report_epochs) + 3)]
    for name, r in results.items():
        if r["error"]:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * (len(args.report_epochs) + 2))
            continue
        ratio = (f"{dense['bytes_per_step'] / r['bytes_per_step']:.1f}x"
                 if dense and not dense["error"] and r["bytes_per_step"] else "")
        accs = " | ".join(f"{100 * r['accuracy'][e - 1]:.2f}%" for e in args.report_epochs)
        lines.append(f"| {name} | {accs} | {r['bytes_per_step'] / 1e6:.3f} | {ratio} | "
                     f"{r['step_ms']:.1f} |")
    return "\n".join(lines)


def svg_plot(results, args) -> str:
    """Final test accuracy against MB sent per step (log scale), one labelled point each."""
    import math
    points = [(name, r["bytes_per_step"] / 1e6, 100 * r["accuracy"][-1])
              for name, r in results.items() if not r["error"] and r["bytes_per_step"] > 0]
    width, height, left, bottom, top, right = 720, 440, 70, 50, 30, 150
    xs = [math.log10(mb) for _, mb, _ in points] or [0]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs)) + (min(xs) == max(xs))
    lo = min([acc for _, _, acc in points] or [0])
    y0, y1 = math.floor(lo / 5) * 5, 100

    def px(mb):
        return left + (math.log10(mb) - x0) / (x1 - x0) * (width - left - right)

    def py(acc):
        return height - bottom - (acc - y0) / (y1 - y0) * (height - bottom - top)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<text x="{width / 2}" y="18" text-anchor="middle">digits MLP, {args.ranks} ranks, '
           f'{args.epochs} epochs: test accuracy against bytes sent</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" '
           f'stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" '
           f'stroke="black"/>']
    for e in range(x0, x1 + 1):
        x = px(10 ** e)
        out.append(f'<line x1="{x}" y1="{height - bottom}" x2="{x}" y2="{height - bottom + 5}" '
                   f'stroke="black"/><text x="{x}" y="{height - bottom + 18}" '
                   f'text-anchor="middle">{10.0 ** e:g}</text>')
    for acc in range(int(y0), int(y1) + 1, 5):
        y = py(acc)
        out.append(f'<line x1="{left - 5}" y1="{y}" x2="{left}" y2="{y}" stroke="black"/>'
                   f'<text x="{left - 8}" y="{y + 4}" text-anchor="end">{acc}%</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">'
               f'MB sent per step, all ranks (log scale)</text>')
    for name, mb, acc in points:
        out.append(f'<circle cx="{px(mb):.1f}" cy="{py(acc):.1f}" r="4" fill="steelblue"/>'
                   f'<text x="{px(mb) + 7:.1f}" y="{py(acc) + 4:.1f}">{name} '
                   f'({acc:.1f}%)</text>')
    out.append("</svg>")
    return "\n".join(out)


def run_job(args, configs) -> dict:
    """Runs `configs` in one set of --ranks processes; a job that dies (torch's PowerSGD hook on
    gloo aborts the process) or outlives its deadline is reported as failed."""
    from ringcomm.bench.common import free_port
    job = argparse.Namespace(**{**vars(args), "configs": configs})
    # Forks: this process has imported torch, the model and the data's library already (spawned
    # ranks import them again, 3.5 s of CPU each on two cores).
    queue = mp.get_context("fork").SimpleQueue()
    context = mp.start_processes(worker, args=(job, free_port(), queue), nprocs=args.ranks,
                                 join=False, start_method="fork")
    limit = args.group_timeout + 15 * args.epochs * len(configs)
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hung: no result within {limit:.0f} s (processes killed)")
    except Exception as e:  # noqa: BLE001 - a failed job is a result
        for p in context.processes:
            if p.is_alive():
                p.kill()
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        print(f"  {', '.join(configs)}: failed: {error}", flush=True)
        return {name: dict(error=error) for name in configs}
    return queue.get()


def main(argv=None):
    args = parse_args(argv)
    print(f"digits MLP 64-{args.width}-{args.width}-10, {args.ranks} ranks, {args.epochs} epochs, "
          f"global batch {args.batch_size}, SGD lr {args.lr} momentum 0.9, seed {args.seed}",
          flush=True)
    # torch's own hooks run in processes of their own: they may take the process down
    ours = [name for name in args.configs if not name.startswith("torch-")]
    results = run_job(args, ours) if ours else {}
    for name in args.configs:
        if name.startswith("torch-"):
            results.update(run_job(args, [name]))
    results = {name: results[name] for name in args.configs}
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    if args.plot:
        with open(args.plot, "w") as f:
            f.write(svg_plot(results, args))


if __name__ == "__main__":
    main()
