"""Gradient compression against dense float32 and the 16-bit baseline, on runs it was not tuned
on: a matrix of run lengths, rank counts, models and seeds, every compression in every cell, in
one run. Per cell: final test accuracy, bytes sent, mean step time (the first steps included) and
time to accuracy (training seconds until the test accuracy first comes within 1 point of dense's
final one), then the checks the defaults must pass, and a plot.

    python bench/compression_quality.py                       # the whole matrix, ranks on this host
    python bench/compression_quality.py --cluster 1gbit --json bench/results/quality.json \\
        --plot quality.svg        # each rank count on simulated 1 Gbit/s hosts (bench/simcluster)
    python bench/compression_quality.py --ranks 4 --steps 200 --models digits \\
        --configs dense,topk,topk/residual_limit=4,path/to/mine.py:MyCompressor

Models: "digits", the MLP 64-W-W-10 of examples/train_ddp.py on scikit-learn's digits (W =
--width); "classification", an MLP F-W/2-W/2-10 on scikit-learn's make_classification with F =
--features features, 10 classes. Every configuration of a cell trains from the same initial
weights on the same batches (--batch per rank), with SGD (--lr, momentum 0.9), DDP over gloo, and
rank 0 measures test accuracy --evals times along the run (outside the timed steps). Gradients are
averaged by DDP's own gloo all-reduce ("dense", float32) or by a ringcomm comm hook; "bf16" is the
16-bit baseline; "local" does not communicate: its step time is the computation's, the floor of
every other's. A configuration is a name below, with settings of its state after slashes
(topk/ratio=0.001/schedule='fixed'), or FILE.py:CLASS / MODULE:CLASS naming a
ringcomm.compress.Compressor, built without arguments and run by ringcomm.hooks.compressor_hook.
Bytes are what every rank sent, over TCP (all of the process's sockets) and through ringcomm's
shared memory, summed over ranks, per step. Each configuration gets its own gloo group with a
short timeout, so one that fails is reported as failed and the others still run; torch's own
hooks run in processes of their own, since its PowerSGD hook on gloo can abort the process.

With --cluster RATE each rank count runs on that many simulated hosts (bench/simcluster: network
namespaces, links shaped to RATE; needs root), one rank each, so step times are those of a
network; without it the ranks share this host and step times say little about a network.
"""

import argparse
import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import train_ddp  # noqa: E402  (the digits data split and the byte counters)

import ringcomm  # noqa: E402,F401  (registers the backend)
from ringcomm import hooks  # noqa: E402
from ringcomm.bench.common import run_metadata  # noqa: E402
from ringcomm.compress import Compressor  # noqa: E402


def state(make_state, hook, **settings):
    return lambda: (make_state(**settings), hook)


def torch_powersgd(rank):
    def make():
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

        return (
            torch_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=10
            ),
            torch_hook.powerSGD_hook,
        )

    return make


def local_hook(state, bucket):
    """No communication: each rank keeps its own gradient. Its step time is the floor of every
    configuration's, the computation alone (its accuracy means nothing)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# name -> () -> (hook state, hook), or None for DDP's own all-reduce
CONFIGS = {
    "dense": None,
    "local": lambda: (None, local_hook),
    "fp16": lambda: (None, hooks.fp16_compress_hook),
    "bf16": lambda: (None, hooks.bf16_compress_hook),
    "topk": state(hooks.TopKState, hooks.topk_hook),  # the defaults
    "topk-fixed": state(hooks.TopKState, hooks.topk_hook, schedule="fixed"),
    "topk-10%": state(hooks.TopKState, hooks.topk_hook, ratio=0.1),
    "topk-0.1%": state(hooks.TopKState, hooks.topk_hook, ratio=0.001),
    "topk-dgc": state(hooks.TopKState, hooks.topk_hook),  # with take_momentum(optimizer)
    "quantize": state(hooks.QuantizeState, hooks.quantize_hook),  # the defaults
    "quantize-stochastic": state(hooks.QuantizeState, hooks.quantize_hook, rounding="stochastic"),
    "powersgd-1": state(hooks.PowerSGDState, hooks.powersgd_hook, matrix_approximation_rank=1),
    "powersgd-2": state(hooks.PowerSGDState, hooks.powersgd_hook, matrix_approximation_rank=2),
    "powersgd-4": state(hooks.PowerSGDState, hooks.powersgd_hook, matrix_approximation_rank=4),
    "torch-powersgd-4": torch_powersgd(4),
}
DEFAULTS = ("topk", "quantize")  # the compressions the checks hold to dense and bf16
MODELS = ("digits", "classification")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", default="2,4,8", help="rank counts (comma-separated)")
    p.add_argument("--steps", default="50,200,1000", help="run lengths in optimizer steps")
    p.add_argument("--models", default=",".join(MODELS), help=f"from {', '.join(MODELS)}")
    p.add_argument(
        "--seeds",
        default="0",
        help="seeds (comma-separated): initial weights, data order, synthetic data",
    )
    p.add_argument(
        "--configs",
        default="dense,bf16,topk,quantize",
        # argparse formats help with %: the names' own % signs are doubled
        help=f"comma-separated, from: {', '.join(CONFIGS).replace('%', '%%')}; with "
        f"settings: topk/ratio=0.001/schedule='fixed'; or FILE.py:CLASS, "
        f"MODULE:CLASS (a ringcomm.compress.Compressor)",
    )
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--features", type=int, default=4096, help="classification's input features")
    p.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--evals", type=int, default=20, help="test accuracy measurements per run")
    p.add_argument(
        "--cluster",
        metavar="RATE",
        help="run each rank count on simulated hosts linked at RATE (e.g. 1gbit)",
    )
    p.add_argument(
        "--group-timeout",
        type=float,
        default=300,
        help="seconds before a configuration's stuck collective fails it",
    )
    p.add_argument("--json", help="write every result here")
    p.add_argument("--plot", help="write an SVG of accuracy against dense's, per cell, here")
    p.add_argument("--worker-json", help=argparse.SUPPRESS)  # a rank under bench/simcluster
    args = p.parse_args(argv)
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    args.ranks, args.steps, args.seeds = ints(args.ranks), ints(args.steps), ints(args.seeds)
    args.models, args.configs = args.models.split(","), args.configs.split(",")
    unknown = [c for c in args.configs if ":" not in c and split_config(c)[0] not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if set(args.models) - set(MODELS) or not args.models:
        p.error(f"--models takes {', '.join(MODELS)}")
    if min(args.ranks + args.steps) < 1 or args.evals < 1 or args.batch < 1:
        p.error("--ranks, --steps, --evals and --batch must be positive")
    return args


# -- models and data ---------------------------------------------------------------------------


def mlp(inputs: int, width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def classification(features: int, seed: int):
    """(train x, train y, test x, test y): make_classification's 16,000 examples of `features`
    features (96 of them informative or redundant, the rest noise), 10 classes of one cluster
    each, standardized, split 80/20. The MLP learns it to about 80% (3,200 test examples: a
    standard error of 0.7 points), where closer classes (class_sep 1, two clusters each) leave
    it near chance and the comparison with dense without resolution."""
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=16000,
        n_features=features,
        n_informative=48,
        n_redundant=48,
        n_classes=10,
        n_clusters_per_class=1,
        class_sep=2.0,
        flip_y=0.01,
        random_state=seed,
    )
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(y, dtype=torch.int64)
    n_train = len(y) * 4 // 5
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def dataset(name: str, args, seed: int, cache={}):  # noqa: B006 - one per process, on purpose
    key = (name, seed)
    if key not in cache:
        cache[key] = (
            train_ddp.digits(seed) if name == "digits" else classification(args.features, seed)
        )
    return cache[key]


def model_for(name: str, args, seed: int) -> torch.nn.Module:
    if name == "digits":
        return mlp(64, args.width, seed)
    return mlp(args.features, args.width // 2, seed)


# -- configurations -----------------------------------------------------------------------------


def split_config(name: str):
    """(base, [settings]): topk/ratio=0.1 -> ("topk", ["ratio=0.1"]); a FILE.py:CLASS's path keeps
    its slashes."""
    if ":" in name:
        where, rest = name.rsplit(":", 1)
        cls, *settings = rest.split("/")
        return f"{where}:{cls}", settings
    base, *settings = name.split("/")
    return base, settings


def compressor_class(spec: str):
    """FILE.py:CLASS or MODULE:CLASS: the class."""
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        module_name = os.path.splitext(os.path.basename(where))[0]
        loaded = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(loaded)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its own imports
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    cls = getattr(module, name)
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"{spec} is not a ringcomm.compress.Compressor")
    return cls


def make_config(name: str, optimizer):
    """(state, hook) for configuration `name` (None, None: DDP's own all-reduce)."""
    base, settings = split_config(name)
    if ":" in base:
        made = (compressor_class(base)(), hooks.compressor_hook)
    elif CONFIGS[base] is None:
        return None, None
    else:
        made = CONFIGS[base]()
    hook_state, hook = made
    for setting in settings:
        key, value = setting.split("=", 1)
        current = getattr(hook_state, key)
        setattr(
            hook_state,
            key,
            getattr(torch, value) if isinstance(current, torch.dtype) else ast.literal_eval(value),
        )
    if settings and hasattr(hook_state, "__post_init__"):
        hook_state.__post_init__()
    if base == "topk-dgc":
        hook_state.take_momentum(optimizer)
    return hook_state, hook


def config_label(name: str) -> str:
    """A file's path shortened to its name: the same label wherever the bench is started."""
    base, settings = split_config(name)
    if ":" in base:
        where, cls = base.rsplit(":", 1)
        base = f"{os.path.basename(where)}:{cls}"
    return "/".join([base] + settings)


# -- one rank ---------------------------------------------------------------------------------


def train(args, model_name, steps, seed, config, group, rank, world):
    """Trains one configuration of one cell; returns its accuracy curve (rank 0: (step, training
    seconds, accuracy) at each evaluation), bytes and step time."""
    train_x, train_y, test_x, test_y = dataset(model_name, args, seed)
    model = DDP(model_for(model_name, args, seed), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hook_state, hook = make_config(config, optimizer)
    if hook is not None:
        model.register_comm_hook(hook_state, hook)
    per_step = args.batch * world
    every = max(1, steps // args.evals)
    shuffle = torch.Generator().manual_seed(seed)
    order, position = None, len(train_y)
    curve, seconds, sent = [], 0.0, 0
    for step in range(steps):
        if position + per_step > len(train_y):  # a new epoch, the same order on every rank
            order, position = torch.randperm(len(train_y), generator=shuffle), 0
        batch = order[position + rank * args.batch :][: args.batch]
        position += per_step
        before, start = train_ddp.bytes_sent(), time.perf_counter()
        F.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds += time.perf_counter() - start
        sent += train_ddp.bytes_sent() - before
        if (step + 1) % every == 0 or step + 1 == steps:
            if rank == 0:
                with torch.no_grad():
                    accuracy = (model.module(test_x).argmax(1) == test_y).float().mean().item()
                curve.append((step + 1, seconds, accuracy))
            dist.barrier(group)  # the others wait here, not in their next timed step
    stats = getattr(hook_state, "stats", None)
    counts = (
        {}
        if stats is None
        else dict(
            dense_buckets=getattr(stats, "dense_buckets", 0),
            compressed_buckets=getattr(stats, "compressed_buckets", 0),
            dense_reasons=getattr(stats, "dense_reasons", {}),
        )
    )
    del model  # before its group goes (see examples/train_ddp.py)
    return dict(curve=curve, bytes_per_step=sent / steps, step_ms=1e3 * seconds / steps, **counts)


def worker(rank, world, args, report):
    """Every cell of the matrix for this rank count, one configuration after the other; rank 0
    hands its records to report()."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # The hooks' communicator, made now: made by the first hook call, its setup (the link probe
    # sends MBs) would count as the first ringcomm configuration's bytes.
    hooks.default_communicator()
    records = []
    for model_name in args.models:
        for steps in args.steps:
            for seed in args.seeds:
                for config in args.configs:
                    records.append(run_config(args, model_name, steps, seed, config, rank, world))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        report(records)


def run_config(args, model_name, steps, seed, config, rank, world) -> dict:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.group_timeout))
    try:
        result, error = train(args, model_name, steps, seed, config, group, rank, world), ""
    except Exception as e:  # reported, and the next configuration runs
        result, error = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if os.environ.get("QUALITY_TRACEBACK"):
            traceback.print_exc()
    # every rank learns whether any failed, and the sums of bytes and step times (default group)
    totals = torch.tensor(
        [float(bool(error)), result.get("bytes_per_step", 0.0), result.get("step_ms", 0.0)],
        dtype=torch.float64,
    )
    dist.all_reduce(totals)
    failed = int(totals[0])
    record = dict(
        result,
        model=model_name,
        ranks=world,
        steps=steps,
        seed=seed,
        config=config_label(config),
        error=error or (f"failed on {failed} other rank(s)" if failed else ""),
        bytes_per_step=totals[1].item(),
        step_ms=totals[2].item() / world,
    )
    record["accuracy"] = record["curve"][-1][2] if record.get("curve") else None
    if rank == 0:
        print(
            f"  {model_name}, {world} ranks, {steps} steps, seed {seed}, {record['config']}: "
            f"{row_text(record)}",
            flush=True,
        )
    return record


def row_text(r: dict) -> str:
    if r["error"]:
        return f"failed: {r['error']}"
    return (
        f"accuracy {100 * r['accuracy']:6.2f}%  {r['bytes_per_step'] / 1e6:8.3f} MB/step  "
        f"{r['step_ms']:7.1f} ms/step"
    )


# -- the matrix ---------------------------------------------------------------------------------


def job_configs(args):
    """The configurations in groups run by one set of processes each: torch's own hooks alone
    (they may take their process down)."""
    ours = [c for c in args.configs if not c.startswith("torch-")]
    return ([ours] if ours else []) + [[c] for c in args.configs if c.startswith("torch-")]


def failed_records(args, world, configs, error: str) -> list:
    print(f"  {world} ranks, {', '.join(configs)}: failed: {error}", flush=True)
    return [
        dict(
            model=m,
            ranks=world,
            steps=s,
            seed=seed,
            config=config_label(c),
            error=error,
            accuracy=None,
            curve=[],
            bytes_per_step=0.0,
            step_ms=0.0,
        )
        for m in args.models
        for s in args.steps
        for seed in args.seeds
        for c in configs
    ]


def local_job(args, world, configs) -> list:
    """`world` ranks forked on this host; a job that dies or outlives its deadline is reported
    as failed."""
    from ringcomm.bench.common import free_port

    job = argparse.Namespace(**{**vars(args), "configs": configs})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # Forks: this process has imported torch and the data's library already (spawned ranks
    # import them again, 3.5 s of CPU each on two cores), and made the data sets the ranks share.
    for model_name in args.models:
        for seed in args.seeds:
            dataset(model_name, args, seed)
    queue = mp.get_context("fork").SimpleQueue()
    context = mp.start_processes(
        lambda rank: worker(rank, world, job, queue.put),
        nprocs=world,
        join=False,
        start_method="fork",
    )
    limit = (
        args.group_timeout
        + 0.5 * sum(args.steps) * len(args.models) * len(args.seeds) * len(configs) * world
    )
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hung: no result within {limit:.0f} s (processes killed)")
    except Exception as e:  # noqa: BLE001 - a failed job is a result
        for p in context.processes:
            if p.is_alive():
                p.kill()
        return failed_records(
            args, world, configs, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        )
    return queue.get()


def cluster_job(args, world, configs) -> list:
    """`world` ranks on `world` simulated hosts (bench/simcluster run), this script as each."""
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        part = os.path.join(tmp, "records.json")
        forwarded = [
            "--steps",
            ",".join(map(str, args.steps)),
            "--models",
            ",".join(args.models),
            "--seeds",
            ",".join(map(str, args.seeds)),
            "--configs",
            ",".join(configs),
            "--width",
            str(args.width),
            "--features",
            str(args.features),
            "--batch",
            str(args.batch),
            "--lr",
            str(args.lr),
            "--evals",
            str(args.evals),
            "--group-timeout",
            str(args.group_timeout),
            "--worker-json",
            part,
        ]
        cmd = [
            os.path.join(HERE, "simcluster"),
            "run",
            str(world),
            args.cluster,
            "--out",
            os.path.join(tmp, "logs"),
            "--",
            sys.executable,
            os.path.abspath(__file__),
        ]
        run = subprocess.run(cmd + forwarded)
        if run.returncode != 0 or not os.path.exists(part):
            return failed_records(
                args, world, configs, f"bench/simcluster run exited with {run.returncode}"
            )
        with open(part) as f:
            return json.load(f)


def cluster_worker(args):
    """This process is one rank under bench/simcluster (env:// variables)."""

    def report(records):
        with open(args.worker_json, "w") as f:
            json.dump(records, f)

    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, report)


# -- the report ---------------------------------------------------------------------------------


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(records: list, args) -> dict:
    """Per cell (model, ranks, steps) and configuration: the means over seeds of accuracy,
    bytes per step, step time and time to accuracy (None: a seed never got there)."""
    ok = [r for r in records if not r["error"]]
    dense = {
        (r["model"], r["ranks"], r["steps"], r["seed"]): r for r in ok if r["config"] == "dense"
    }
    cells = {}
    for r in ok:
        key = (r["model"], r["ranks"], r["steps"])
        base = dense.get(key + (r["seed"],))
        target = None if base is None else base["accuracy"] - 0.01
        reached = (
            None
            if target is None
            else next((seconds for _, seconds, acc in r["curve"] if acc >= target), None)
        )
        cell = cells.setdefault(key, {}).setdefault(r["config"], [])
        cell.append(
            dict(
                accuracy=r["accuracy"],
                bytes=r["bytes_per_step"],
                step_ms=r["step_ms"],
                tta=reached,
                reached=reached is not None or target is None,
            )
        )
    out = {}
    for key, configs in cells.items():
        out[key] = {
            name: dict(
                accuracy=mean(s["accuracy"] for s in runs),
                bytes=mean(s["bytes"] for s in runs),
                step_ms=mean(s["step_ms"] for s in runs),
                tta=mean(s["tta"] for s in runs) if all(s["reached"] for s in runs) else None,
                seeds=len(runs),
            )
            for name, runs in configs.items()
        }
    return out


def tables(summary: dict, records: list) -> str:
    lines = []
    head = (
        "| steps | configuration | accuracy | vs dense (points) | MB/step (all ranks) | "
        "dense bytes / these | step (ms) | bf16 step / this | time to dense - 1 point (s) |"
    )
    for model in sorted({k[0] for k in summary}):
        for ranks in sorted({k[1] for k in summary if k[0] == model}):
            lines += ["", f"{model}, {ranks} ranks:", "", head, "|---:|---|" + "---:|" * 7]
            for steps in sorted({k[2] for k in summary if k[:2] == (model, ranks)}):
                cell = summary[(model, ranks, steps)]
                dense, bf16 = cell.get("dense"), cell.get("bf16")
                for name, c in cell.items():
                    vs = (
                        "" if dense is None else f"{100 * (c['accuracy'] - dense['accuracy']):+.2f}"
                    )
                    fewer = (
                        ""
                        if dense is None or not c["bytes"]
                        else f"{dense['bytes'] / c['bytes']:.1f}x"
                    )
                    faster = (
                        ""
                        if bf16 is None or not c["step_ms"]
                        else f"{bf16['step_ms'] / c['step_ms']:.2f}x"
                    )
                    tta = "not reached" if c["tta"] is None else f"{c['tta']:.2f}"
                    lines.append(
                        f"| {steps} | {name} | {100 * c['accuracy']:.2f}% | {vs} | "
                        f"{c['bytes'] / 1e6:.3f} | {fewer} | {c['step_ms']:.1f} | "
                        f"{faster} | {tta} |"
                    )
    failed = [r for r in records if r["error"]]
    if failed:
        lines += ["", "Failed:"] + [
            f"  {r['model']}, {r['ranks']} ranks, {r['steps']} steps, "
            f"seed {r['seed']}, {r['config']}: {r['error']}"
            for r in failed
        ]
    return "\n".join(lines)


def checks(summary: dict, args) -> list:
    """The defaults against dense and bf16: (what, holds, detail) for each check that the matrix
    has the configurations for."""
    out = []
    for name in DEFAULTS:
        cells = [(k, c) for k, c in summary.items() if name in c and "dense" in c]
        if not cells:
            continue
        worst = min(cells, key=lambda kc: kc[1][name]["accuracy"] - kc[1]["dense"]["accuracy"])
        gap = 100 * (worst[1][name]["accuracy"] - worst[1]["dense"]["accuracy"])
        out.append(
            (
                f"{name} within 1 point of dense in every cell",
                gap >= -1.0,
                f"worst {gap:+.2f} points ({worst[0][0]}, {worst[0][1]} ranks, "
                f"{worst[0][2]} steps)",
            )
        )
    cells = [(k[2], c) for k, c in summary.items() if "topk" in c and "dense" in c]
    if cells:  # all the bytes each sent over the matrix: per step times steps
        ratio = sum(steps * c["dense"]["bytes"] for steps, c in cells) / sum(
            steps * c["topk"]["bytes"] for steps, c in cells
        )
        out.append(
            (
                "topk sends at least 4x fewer bytes than dense over the matrix",
                ratio >= 4,
                f"{ratio:.1f}x",
            )
        )
    cells = [
        (k, c)
        for k, c in summary.items()
        if k[1] == 4 and k[2] >= 200 and "topk" in c and "bf16" in c
    ]
    if cells and args.cluster:
        worst = min(cells, key=lambda kc: kc[1]["bf16"]["step_ms"] / kc[1]["topk"]["step_ms"])
        speedup = worst[1]["bf16"]["step_ms"] / worst[1]["topk"]["step_ms"]
        out.append(
            (
                f"topk steps at least 2x faster than bf16 on 4 hosts at {args.cluster}, "
                f"200 steps and more",
                speedup >= 2,
                f"slowest {speedup:.2f}x ({worst[0][0]}, {worst[0][2]} steps)",
            )
        )
    return out


def svg_plot(summary: dict, args) -> str:
    """Per model (rows) and rank count (columns): accuracy minus dense's, in points, against the
    run length, one line per configuration, and the 1-point band."""
    keys = sorted(summary)
    models = sorted({k[0] for k in keys})
    ranks = sorted({k[1] for k in keys})
    lengths = sorted({k[2] for k in keys})
    names = [c for c in dict.fromkeys(n for cell in summary.values() for n in cell) if c != "dense"]
    colors = [
        "#1f77b4",
        "#d62728",
        "#2ca02c",
        "#9467bd",
        "#ff7f0e",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
    ]
    pw, ph, left, top = 260, 200, 60, 40
    width, height = left + pw * len(ranks) + 180, top + ph * len(models) + 40
    lo, hi = -5.0, 2.0
    hosts = f", {args.cluster} hosts" if args.cluster else ""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<text x="{width / 2}" y="16" text-anchor="middle">accuracy minus dense float32\'s '
        f"(points) against optimizer steps{hosts}</text>",
    ]
    for row, model in enumerate(models):
        for col, n in enumerate(ranks):
            x0, y0 = left + col * pw, top + row * ph
            inner_w, inner_h = pw - 30, ph - 40

            def px(i, x0=x0, inner_w=inner_w):
                return x0 + (i + 0.5) / len(lengths) * inner_w

            def py(points, y0=y0, inner_h=inner_h):
                return y0 + (hi - max(lo, min(hi, points))) / (hi - lo) * inner_h

            out.append(
                f'<rect x="{x0}" y="{py(0)}" width="{inner_w}" height="{py(-1) - py(0)}" '
                f'fill="#eee"/><rect x="{x0}" y="{y0}" width="{inner_w}" '
                f'height="{inner_h}" fill="none" stroke="black"/>'
                f'<text x="{x0 + inner_w / 2}" y="{y0 - 4}" text-anchor="middle">{model}, '
                f"{n} ranks</text>"
            )
            for i, steps in enumerate(lengths):
                out.append(
                    f'<text x="{px(i)}" y="{y0 + inner_h + 14}" text-anchor="middle">{steps}</text>'
                )
            for value in (hi, 0, -1, lo):
                out.append(
                    f'<text x="{x0 - 4}" y="{py(value) + 4}" text-anchor="end">{value:+g}</text>'
                )
            for c, name in enumerate(names):
                points = []
                for i, steps in enumerate(lengths):
                    cell = summary.get((model, n, steps), {})
                    if name in cell and "dense" in cell:
                        gap = 100 * (cell[name]["accuracy"] - cell["dense"]["accuracy"])
                        points.append(f"{px(i):.1f},{py(gap):.1f}")
                color = colors[c % len(colors)]
                if points:
                    out.append(
                        f'<polyline points="{" ".join(points)}" fill="none" '
                        f'stroke="{color}" stroke-width="2"/>'
                    )
    for c, name in enumerate(names):
        y = top + 14 * c
        out.append(
            f'<rect x="{width - 170}" y="{y}" width="12" height="4" '
            f'fill="{colors[c % len(colors)]}"/><text x="{width - 152}" y="{y + 6}">'
            f"{name}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def write_json(args, records: list, results) -> None:
    """--json: the records so far and, once the matrix is done (`results`, else None), its
    checks; `complete` says which."""
    if not args.json:
        return
    report = dict(
        **run_metadata(),
        args=vars(args),
        complete=results is not None,
        results=records,
        checks=[dict(check=w, holds=h, detail=d) for w, h, d in results or []],
    )
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    if args.worker_json:
        cluster_worker(args)
        return
    where = f"simulated hosts at {args.cluster}" if args.cluster else "ranks on this host"
    print(
        f"models {', '.join(args.models)} (width {args.width}, {args.features} features); "
        f"ranks {args.ranks} ({where}); steps {args.steps}; seeds {args.seeds}; batch "
        f"{args.batch} per rank; SGD lr {args.lr} momentum 0.9",
        flush=True,
    )
    records = []
    for world in args.ranks:
        for configs in job_configs(args):
            job = cluster_job if args.cluster else local_job
            records += job(args, world, configs)
            write_json(args, records, None)  # what has run, should the rest not
    order = {config_label(c): i for i, c in enumerate(args.configs)}
    records.sort(key=lambda r: (r["model"], r["ranks"], r["steps"], r["seed"], order[r["config"]]))
    summary = summarize(records, args)
    print(tables(summary, records))
    results = checks(summary, args)
    if results:
        print()
    for what, holds, detail in results:
        print(f"{'PASS' if holds else 'FAIL'}  {what}: {detail}")
    write_json(args, records, results)
    if args.plot:
        with open(args.plot, "w") as f:
            f.write(svg_plot(summary, args))


if __name__ == "__main__":
    main()
