"""Trains an MLP on scikit-learn's digits with DDP, gradients averaged by gloo or ringcomm.

    torchrun --nproc-per-node 2 examples/train_ddp.py --hook allreduce --width 2048
    torchrun --nproc-per-node 2 examples/train_ddp.py --backend ringcomm --hook none
    torchrun --nproc-per-node 2 examples/train_ddp.py --hook allreduce --width 2048 --compare-gloo --compare-floor

--backend picks the process group DDP runs on; --hook registers a ringcomm comm hook on it ("none":
DDP's own all-reduce through that backend; "local": no communication, the floor of the step time;
"sync-floor": the ranks only wait for each other, the least a synchronous step costs;
"reduce-floor": they wait, then each adds a local tensor into its bucket; "topk-floor": top-k's
own work with no network, the least a top-k step costs). --width 2048 gives two hidden layers of
2048, about 4.3M parameters, enough for communication to matter. --compare-gloo also trains
gloo's default DDP from the same initial weights on the same batches, alternating steps with the
run above so both see the same machine load, and prints both; --compare-floor does the same with
"local", "sync-floor" and "reduce-floor" (and "topk-floor" when the hook is topk), so the floor
of the step time and the limits of an averaged step are measured in the same run. Rank 0 prints
test accuracy, the mean step time (forward, backward with its communication, optimizer step;
after --warmup steps) of the slowest rank (the floor's ranks each go at their own pace, a job at
its slowest's), the CPU time of all ranks per step (every thread; with more ranks than cores it
bounds the step from below: CPU time / cores) and the bytes this rank sent per step: over TCP
(Linux's per-socket counters, all of the process's connections) plus what ringcomm wrote to
shared memory for ranks on this host. Then the step split into forward, backward until its last
gradient, backward after it (waiting for the averages) and optimizer, and for ringcomm's hooks
what each bucket sent and how long its average took. With
RINGCOMM_TIMELINE=path, the timeline shows the phases of each step beside ringcomm's work.
"""

import argparse
import ast
import os
import socket
import struct
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm  # registers the "ringcomm" backend
from ringcomm import compress, hooks, trace


def local_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No communication at all: each rank keeps its own gradient. Not training, a floor: the
    step time of compute and DDP alone, which no averaging can beat."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ranks_met() -> torch.futures.Future:
    """Completes once every rank has called it: an 8-byte all-reduce."""
    return hooks.communicator_for(None).all_reduce(torch.zeros(2), async_op=True).get_future()


def sync_floor_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Not training either: the ranks only wait for each other, each keeping its own gradient.
    What a synchronous step pays before any byte of the average moves: every step goes at the
    slower rank's pace, where the floor's ranks each go at their own."""
    buffer = bucket.buffer()
    return ranks_met().then(lambda _: buffer)


_peer_stand_ins = {}


def reduce_floor_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Not training either: the ranks wait for each other, then each adds a stand-in for its
    peer's gradient into the bucket: the memory traffic of a reduction of the whole bucket that
    reads the peer's data in place (read two, write one), with no copy and no transport. Not a
    bound on an all-reduce that splits the reduction among the ranks (the shared buffer: each
    rank reduces its 1/n), which can beat it."""
    buffer = bucket.buffer()
    # by size: DDP rebuilds its buckets after the first step
    stand_in = _peer_stand_ins.setdefault(buffer.numel(), torch.zeros_like(buffer))
    return ranks_met().then(lambda _: buffer.add_(stand_in))  # off the autograd thread


def topk_floor_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Not training either: top-k's own work with no network, the least a top-k step costs where
    compute is what bounds it (more ranks than cores). The real selection with error feedback, at
    the state's density schedule (its dense steps: only the residuals' memory, prepared as
    topk_hook prepares it), the rounding to the wire type, then a sparse all-reduce's work as if
    every rank had sent these pairs: the bucket zeroed, the pairs added world-size times,
    divided."""
    flat = bucket.buffer()
    density = state.density()
    if density < 1:
        world = dist.get_world_size()
        residual = state.memory.get("residuals", bucket.index(), flat)
        values, indices = compress.topk_with_residual(
            flat, residual, max(1, int(flat.numel() * density)), state.value_dtype
        )
        wire, positions = values.to(flat.dtype), indices.long()
        flat.zero_()
        for _ in range(world):
            flat.index_add_(0, positions, wire)
        flat.div_(world)
    elif state.density(state.step + 1) < 1:
        state.memory.prepare(flat)  # as topk_hook does on its last dense step
    if bucket.is_last():
        state.step += 1
    fut = torch.futures.Future()
    fut.set_result(flat)
    return fut


HOOKS = {
    "none": None,
    "allreduce": hooks.allreduce_hook,
    "fp16": hooks.fp16_compress_hook,
    "bf16": hooks.bf16_compress_hook,
    "topk": hooks.topk_hook,
    "local": local_hook,
    "sync-floor": sync_floor_hook,
    "reduce-floor": reduce_floor_hook,
    "topk-floor": topk_floor_hook,
}
TCP_INFO_BYTES_SENT = 200  # offset of tcpi_bytes_sent (u64, Linux >= 4.19) in struct tcp_info


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", choices=["gloo", "ringcomm"], default="gloo")
    p.add_argument("--hook", choices=list(HOOKS), default="allreduce")
    p.add_argument("--width", type=int, default=256, help="units in each of the two hidden layers")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the mean step time"
    )
    p.add_argument(
        "--ratio", type=float, default=0.01, help="--hook topk: fraction of entries sent"
    )
    p.add_argument(
        "--topk",
        action="append",
        default=[],
        metavar="SETTING=VALUE",
        help="--hook topk: a TopKState setting other than its default, e.g. "
        "warmup_steps=0, value_dtype=float32, adaptive=False (repeatable)",
    )
    p.add_argument(
        "--compare-gloo",
        action="store_true",
        help="also train gloo's default DDP, alternating steps, and print both",
    )
    p.add_argument(
        "--compare-floor",
        action="store_true",
        help="also train with no communication (the local hook) and with the limits "
        "of an averaged step (sync-floor, reduce-floor; with --hook topk also "
        "topk-floor), alternating steps",
    )
    args = p.parse_args()
    if args.width < 1 or args.epochs < 1 or args.batch_size < 1 or args.warmup < 0:
        p.error("--width, --epochs and --batch-size must be positive, --warmup non-negative")
    return args


def topk_settings(items) -> dict:
    """TopKState keyword arguments from SETTING=VALUE strings (dtypes by name, others literal)."""
    settings = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in hooks.TopKState.SETTINGS:
            raise SystemExit(
                f"--topk {item}: no TopKState setting {key!r}; "
                f"settings: {', '.join(hooks.TopKState.SETTINGS)}"
            )
        settings[key] = getattr(torch, value) if key == "value_dtype" else ast.literal_eval(value)
    return settings


def bytes_sent() -> int:
    """Bytes this process has sent: over all its TCP connections (retransmissions included), and
    through ringcomm's shared memory."""
    return tcp_bytes_sent() + ringcomm.shm_bytes_sent()


def tcp_bytes_sent() -> int:
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(
                fileno=os.dup(int(fd))
            ) as s:  # a duplicate: closing it keeps fd open
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                    total += struct.unpack_from("Q", info, TCP_INFO_BYTES_SENT)[0]
        except OSError:  # closed since listed
            continue
    return total


def digits(seed: int):
    """(train x, train y, test x, test y): 80/20 split of the 1797 8x8 images, pixels in [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = len(y) * 4 // 5
    train, test = order[:n_train], order[n_train:]
    return x[train], y[train], x[test], y[test]


def mlp(width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


class Run:
    """One DDP model, its optimizer and its measurements."""

    def __init__(self, name, args, process_group=None, hook=None):
        self.name = name
        self.topk = None
        self.model = DDP(mlp(args.width, args.seed), process_group=process_group)
        if hook is not None:
            state = None
            if hook in (hooks.topk_hook, topk_floor_hook):
                state = hooks.TopKState(ratio=args.ratio, **topk_settings(args.topk))
            self.model.register_comm_hook(state, hook)
        self.topk = state if hook is hooks.topk_hook else None
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.step_times, self.bytes_sent, self.cpu_seconds = [], 0, 0.0
        # Seconds per phase, summed over the timed steps: forward, backward until its last
        # gradient is computed, backward after it (waiting for the averages: the communication
        # left exposed), optimizer.
        self.phases = dict.fromkeys(("forward", "backward compute", "waiting", "optimizer"), 0.0)
        self.last_gradient = 0.0
        for param in self.model.parameters():
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, _param):
        self.last_gradient = time.perf_counter()

    def step(self, x, y, timed: bool):
        sent_before = bytes_sent()
        start, cpu_start = time.perf_counter(), time.process_time()
        with trace.span("forward", "step"):
            loss = F.cross_entropy(self.model(x), y)
        forward_done = time.perf_counter()
        with trace.span("backward", "step"):
            loss.backward()
        backward_done = time.perf_counter()
        with trace.span("optimizer", "step"):
            self.optimizer.step()
            self.optimizer.zero_grad()
        end = time.perf_counter()
        if timed:
            self.step_times.append(end - start)
            self.cpu_seconds += time.process_time() - cpu_start  # every thread of the process
            self.bytes_sent += bytes_sent() - sent_before
            for phase, seconds in zip(
                self.phases,
                (
                    forward_done - start,
                    self.last_gradient - forward_done,
                    backward_done - self.last_gradient,
                    end - backward_done,
                ),
            ):
                self.phases[phase] += seconds

    @torch.no_grad()
    def accuracy(self, x, y) -> float:
        return (self.model.module(x).argmax(1) == y).float().mean().item()


def main():
    args = parse_args()
    ringcomm.launch.init_process_group(args.backend)  # under torchrun, srun, mpirun or mpiexec
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y, test_x, test_y = digits(args.seed)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks")

    hook_name = {
        "none": "DDP's all-reduce",
        "local": "no communication (floor)",
        "sync-floor": "wait only (sync limit)",
        "reduce-floor": "wait + local a+b (limit)",
        "topk-floor": "top-k, no network (limit)",
    }.get(args.hook, f"ringcomm {args.hook} hook")
    runs = [Run(f"{args.backend}, {hook_name}", args, hook=HOOKS[args.hook])]
    groups = [None]  # the default group, and a gloo group when that is not gloo already
    if args.compare_gloo:
        if args.backend != "gloo":
            groups.append(dist.new_group(backend="gloo"))
        runs.append(Run("gloo, DDP's all-reduce", args, process_group=groups[-1]))
    if args.compare_floor:
        runs.append(Run("no communication (floor)", args, hook=local_hook))
        runs.append(Run("wait only (sync limit)", args, hook=sync_floor_hook))
        runs.append(Run("wait + local a+b (limit)", args, hook=reduce_floor_hook))
        if args.hook == "topk":
            runs.append(Run("top-k, no network (limit)", args, hook=topk_floor_hook))

    per_rank = args.batch_size // world
    steps_per_epoch = len(train_y) // args.batch_size
    if steps_per_epoch * args.epochs <= args.warmup:
        raise SystemExit(
            f"{steps_per_epoch * args.epochs} steps leave none to time after --warmup {args.warmup}"
        )
    step = 0
    for epoch in range(args.epochs):
        # the same shuffle on every rank; each takes its slice of every global batch
        shuffle = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        order = torch.randperm(len(train_y), generator=shuffle)
        for i in range(steps_per_epoch):
            batch = order[i * args.batch_size + rank * per_rank :][:per_rank]
            for run in runs:
                run.step(train_x[batch], train_y[batch], timed=step >= args.warmup)
            step += 1

    cpu = torch.tensor([run.cpu_seconds for run in runs], dtype=torch.float64)
    # CPU time of every rank (all threads), summed by ringcomm rather than gloo: a gloo worker
    # frees a finished all-reduce, and its tensor's Python object, after the caller has moved on,
    # and one still doing so when the interpreter shuts down aborts the process (torch 2.13:
    # "terminate called without an active exception", from the worker taking the GIL).
    hooks.default_communicator().all_reduce(cpu)
    # Each run's mean step time on its slowest rank: a job's pace. The floor's ranks never wait
    # for each other, and one's mean can run a few percent above the other's.
    step_s = torch.tensor(
        [sum(run.step_times) / len(run.step_times) for run in runs], dtype=torch.float64
    )
    hooks.default_communicator().all_reduce(step_s, op="max")
    if rank == 0:
        params = sum(p.numel() for p in runs[0].model.parameters())
        timed = step - args.warmup
        print(
            f"digits: {len(train_y)} train / {len(test_y)} test images; MLP 64-{args.width}-"
            f"{args.width}-10, {params:,} parameters; {world} ranks, global batch {args.batch_size}, "
            f"{step} steps ({timed} timed)"
        )
        print(
            f"{'run':<34} {'test acc':>9} {'step ms':>9} {'steps/s':>8} {'MB sent/step':>13} "
            f"{'CPU ms/step, all ranks':>23}   (step: the slowest rank's mean)"
        )
        for run, cpu_seconds, mean in zip(runs, cpu.tolist(), step_s.tolist()):
            print(
                f"{run.name:<34} {100 * run.accuracy(test_x, test_y):>8.2f}% {1e3 * mean:>9.2f} "
                f"{1 / mean:>8.2f} {run.bytes_sent / timed / 1e6:>13.2f} "
                f"{1e3 * cpu_seconds / timed:>23.1f}"
            )
        for other, mean in zip(runs[1:], step_s.tolist()[1:]):
            ratio = mean / step_s[0].item()
            print(f"steps/s, {runs[0].name} over {other.name}: {ratio:.2f}x")
        print(
            "step time on rank 0, ms per step (waiting: backward after its last gradient, "
            "for the averages)"
        )
        print(
            f"{'run':<34} "
            + " ".join(f"{p:>16}" for p in runs[0].phases)
            + f" {'waiting share':>14}"
        )
        for run in runs:
            total = sum(run.step_times)
            print(
                f"{run.name:<34} "
                + " ".join(f"{1e3 * v / timed:>16.2f}" for v in run.phases.values())
                + f" {100 * run.phases['waiting'] / total:>13.1f}%"
            )
        if args.hook in ("allreduce", "fp16", "bf16", "topk"):
            comm = hooks.communicator_for(runs[0].topk.comm if runs[0].topk else None)
            print(
                "ringcomm hook on rank 0, per bucket and step (all steps): payload MB sent / "
                "received, ms from the hook's call to the average, ms of it the operations ran, "
                "idle in them"
            )
            for index, b in comm.stats()["buckets"].items():
                n = b["calls"]
                print(
                    f"  bucket {index}: {b['bytes_sent'] / n / 1e6:.2f} / "
                    f"{b['bytes_received'] / n / 1e6:.2f} MB, {1e3 * b['comm_s'] / n:.2f} ms, "
                    f"{1e3 * b['run_s'] / n:.2f} ms running, {1e3 * b['idle_s'] / n:.2f} ms idle"
                )
        for run in runs:
            if run.topk is not None:
                s = run.topk.stats
                print(
                    f"top-k on rank 0, all {s.steps} steps: {s.compressed_buckets} buckets "
                    f"compressed, {s.dense_buckets} dense; per step {1e3 * s.compress_seconds / s.steps:.1f} "
                    f"ms selecting, {1e3 * s.exchange_seconds / s.steps:.1f} ms from sparse "
                    f"exchange start to result; {s.compression_ratio:.1f}x fewer bytes than dense"
                )
    # Models first, while torch still holds their groups; then a barrier on each group; then the
    # groups. torch 2.13's gloo destructor joins its worker threads holding the GIL, and a worker
    # still freeing an all-reduce issued during backward needs the GIL (the work carries
    # backward's Python context): dropping a gloo group right after its last all-reduce can hang.
    del runs
    for group in groups:
        dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
