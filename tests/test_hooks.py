"""ringcomm's DDP comm hooks: same parameters as gloo's DDP, overlap, compiled-DDP tuples, errors."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ringcomm import hooks
from ranks import free_port, run_ranks

STEPS = 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 5),
    )


def portable(x):
    """Tensors as lists: a rank exits right after reporting, too early for torch's shared-memory
    pickling of tensors to hand them over."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(portable(v) for v in x)
    return x


def tensors(x):
    if isinstance(x, list):
        return torch.tensor(x)
    if isinstance(x, dict):
        return {k: tensors(v) for k, v in x.items()}
    return tuple(tensors(v) for v in x)


def train(
    rank, hook=None, state=None, process_group=None, no_sync=False, autocast=False, **ddp_args
):
    """A few SGD steps of DDP on rank-dependent data; returns the parameters, flattened."""
    # 10 KB buckets: the 23 KB of gradients travel in several buckets
    ddp = DDP(make_model(), process_group=process_group, bucket_cap_mb=0.01, **ddp_args)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)

    def loss_of_batch():
        x, y = torch.randn(16, 20, generator=data), torch.randint(0, 5, (16,), generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return F.cross_entropy(ddp(x).float(), y)

    for _ in range(STEPS):
        if no_sync:  # one micro-batch accumulated locally, then one synchronised
            with ddp.no_sync():
                loss_of_batch().backward()
        loss_of_batch().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def renamed(hook):
    """torch's own hook under another name: DDP refuses the name bf16_compress_hook without NCCL."""

    def reference_hook(state, bucket):
        return hook(state, bucket)

    return reference_hook


def max_difference(a, b):
    return float((a - b).abs().max())


def hooks_on_gloo(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    gloo_default = train(rank)
    runs = {
        "allreduce": train(rank, hooks.allreduce_hook),
        "fp16": train(rank, hooks.fp16_compress_hook),
        "bf16": train(rank, hooks.bf16_compress_hook),
        "fp16 wrapper": train(rank, hooks.fp16_compress_wrapper(hooks.allreduce_hook)),
        "bf16 wrapper": train(rank, hooks.bf16_compress_wrapper(hooks.allreduce_hook)),
        "torch fp16 on gloo": train(rank, renamed(torch_hooks.fp16_compress_hook)),
        "torch bf16 on gloo": train(rank, renamed(torch_hooks.bf16_compress_hook)),
        # the wrapper around a foreign hook: torch's all-reduce hook on the gloo group
        "fp16 wrapper of torch's": train(
            rank, hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook), state=dist.group.WORLD
        ),
    }
    # the same ringcomm communicator given explicitly as state
    runs["allreduce, communicator state"] = train(
        rank, hooks.allreduce_hook, hooks.default_communicator()
    )
    # a process group with the ringcomm backend as state: its own core communicator
    ringcomm_group = dist.new_group(backend="ringcomm")
    runs["allreduce, ringcomm group state"] = train(rank, hooks.allreduce_hook, ringcomm_group)
    variants = {
        "gradient_as_bucket_view": dict(gradient_as_bucket_view=True),
        "static_graph": dict(static_graph=True),
        "no_sync": dict(no_sync=True),
        "bf16 autocast": dict(autocast=True),
    }
    for name, args in variants.items():
        runs[name] = (train(rank, **args), train(rank, hooks.allreduce_hook, **args))
        runs[name + ", fp16"] = (
            train(rank, renamed(torch_hooks.fp16_compress_hook), **args),
            train(rank, hooks.fp16_compress_hook, **args),
        )
    dist.destroy_process_group()
    return portable((gloo_default, runs))


# Largest parameter differences allowed after STEPS steps (parameters are about 0.1). Measured:
# fp16 2e-5 from fp32 and 1.2e-5 from torch's fp16 hook on gloo; bf16 3e-4 and 3.9e-4.
FP32 = 1e-6
FP16_FROM_FP32, FP16_FROM_TORCH_FP16 = 1e-4, 5e-5
BF16_FROM_FP32, BF16_FROM_TORCH_BF16 = 1e-3, 1e-3


@pytest.mark.parametrize("world", [2, 3])
def test_hooks_match_gloo_default(world):
    results = [tensors(r) for r in run_ranks(world, hooks_on_gloo, make_comm=False, timeout=120)]
    gloo_default, runs = results[0]
    for rank, (other_default, other_runs) in enumerate(results[1:], 1):
        # DDP keeps replicas identical, bit for bit
        assert torch.equal(other_default, gloo_default)
        for name, run in other_runs.items():
            same = (
                all(map(torch.equal, run, runs[name]))
                if isinstance(run, tuple)
                else torch.equal(run, runs[name])
            )
            assert same, f"rank {rank} differs from rank 0: {name}"
    assert max_difference(gloo_default, make_model_parameters()) > 0.01, (
        "training moved the parameters"
    )

    def differs(name, reference, limit):
        d = max_difference(runs[name], reference)
        assert d <= limit, f"{name}: {d} > {limit}"

    differs("allreduce", gloo_default, FP32)
    differs("allreduce, communicator state", gloo_default, FP32)
    differs("allreduce, ringcomm group state", gloo_default, FP32)
    differs("fp16", gloo_default, FP16_FROM_FP32)
    differs("fp16", runs["torch fp16 on gloo"], FP16_FROM_TORCH_FP16)
    differs("fp16 wrapper of torch's", runs["fp16"], FP16_FROM_TORCH_FP16)
    differs("bf16", gloo_default, BF16_FROM_FP32)
    differs("bf16", runs["torch bf16 on gloo"], BF16_FROM_TORCH_BF16)
    assert torch.equal(runs["fp16 wrapper"], runs["fp16"]) and torch.equal(
        runs["bf16 wrapper"], runs["bf16"]
    )
    for name, run in runs.items():
        if isinstance(run, tuple):  # (gloo's, ringcomm's) under a DDP option
            limit = FP16_FROM_TORCH_FP16 if name.endswith("fp16") else FP32
            d = max_difference(*run)
            assert d <= limit, f"{name}: {d} > {limit}"


def make_model_parameters():
    return torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])


def on_ringcomm_backend(store, rank, world):
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    runs = {
        "gloo default": train(rank, process_group=gloo),
        "ringcomm default": train(rank),
        "ringcomm + allreduce_hook, state None": train(rank, hooks.allreduce_hook),
        "ringcomm + allreduce_hook, state group": train(
            rank, hooks.allreduce_hook, dist.group.WORLD
        ),
        "ringcomm + torch's allreduce_hook": train(rank, torch_hooks.allreduce_hook),
        "gloo, no_sync": train(rank, process_group=gloo, no_sync=True),
        "ringcomm, no_sync": train(rank, no_sync=True),
        "ringcomm, static graph, bucket view": train(
            rank, static_graph=True, gradient_as_bucket_view=True
        ),
    }
    dist.destroy_process_group()
    return portable(runs)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_on_ringcomm_backend_matches_gloo(world):
    results = [
        tensors(r) for r in run_ranks(world, on_ringcomm_backend, make_comm=False, timeout=120)
    ]
    runs = results[0]
    for other in results[1:]:
        assert all(torch.equal(other[name], runs[name]) for name in runs)
    for name, run in runs.items():
        reference = runs["gloo, no_sync" if "no_sync" in name else "gloo default"]
        assert max_difference(run, reference) <= 1e-6, name


def overlap(store, rank, world):
    """The hook returns while its all-reduce is still running."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    # The hooks' communicator first: made on first use, its rendezvous would otherwise hold rank
    # 0's first hook until rank 1 arrives, after its sleep, and the all-reduce could then finish
    # before rank 0 looks.
    hooks.default_communicator()
    pending_at_return = []

    calls = []

    def probe(state, bucket):
        calls.append(bucket.index())
        if rank == 1 and len(calls) <= 2:
            time.sleep(0.3)  # rank 0's all-reduces cannot finish before this rank joins them
        fut = hooks.allreduce_hook(state, bucket)
        if len(calls) <= 2:
            pending_at_return.append(not fut.done())
        return fut

    train(rank, probe)
    dist.destroy_process_group()
    return pending_at_return


def test_hook_returns_before_communication_ends():
    rank0, _ = run_ranks(2, overlap, make_comm=False)
    assert rank0 == [True, True]


def compiled_ddp_tuples(store, rank, world):
    """Compiled DDP calls hook(state, (grad, param)) and ignores the future: the averaged
    gradient must be in grad when the hook returns."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    param = torch.nn.Parameter(torch.zeros(1000))
    mean = sum(torch.arange(1000.0) * (r + 1) for r in range(world)) / world
    checked = []
    for name, hook in [
        ("allreduce", hooks.allreduce_hook),
        ("fp16", hooks.fp16_compress_hook),
        ("bf16", hooks.bf16_compress_hook),
        ("bf16 wrapper", hooks.bf16_compress_wrapper(hooks.allreduce_hook)),
    ]:
        grad = torch.arange(1000.0) * (rank + 1)
        fut = hook(None, (grad, param))
        assert fut.done() and fut.value() is grad, name
        tolerance = {"allreduce": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "bf16 wrapper": 1e-2}[name]
        assert torch.allclose(grad, mean, rtol=tolerance, atol=0), (name, grad[:5], mean[:5])
        checked.append(name)
    dist.destroy_process_group()
    return checked


def test_hooks_accept_compiled_ddp_tuples():
    for checked in run_ranks(3, compiled_ddp_tuples, make_comm=False):
        assert len(checked) == 4


def compiled_ddp(store, rank, world):
    """torch.compile'd DDP with compiled autograd: DDP's python reducer calls the hook per
    parameter with (grad, param)."""
    import torch._dynamo

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    model = make_model()
    ddp = DDP(model)
    buckets = []

    def recording_hook(state, bucket):
        buckets.append(type(bucket).__name__)
        return hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, torch.compiler.disable(recording_hook))  # as ringcomm.hooks says
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(rank))

    @torch.compile(backend="eager")  # dynamo without inductor's C++ compile: fast
    def step():
        ddp(x).sum().backward()

    step()
    averaged = [p.grad.clone() for p in model.parameters()]
    torch._dynamo.config.compiled_autograd = False
    model.zero_grad()
    model(x).sum().backward()  # this rank's own gradient, averaged with gloo for reference
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    diff = max(max_difference(a, p.grad) for a, p in zip(averaged, model.parameters()))
    dist.destroy_process_group()
    return sorted(set(buckets)), len(buckets), diff


def test_compiled_ddp_calls_hooks_with_tuples():
    for kinds, calls, diff in run_ranks(2, compiled_ddp, make_comm=False, timeout=120):
        # at least once per parameter (6); torch may call the hooks more than once
        assert kinds == ["tuple"] and calls >= 6 and diff <= 1e-6, (kinds, calls, diff)


def peer_dies(store, rank, world):
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    ddp = DDP(make_model())
    ddp.register_comm_hook(None, hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(8, 20)
    for step in range(1000):
        if rank == 2 and step == 3:
            os._exit(5)
        start = time.monotonic()
        try:
            ddp(x).sum().backward()
            opt.step()
        except RuntimeError as e:
            return step, str(e), time.monotonic() - start
    return None  # never failed


def test_peer_death_raises_in_backward():
    results = run_ranks(3, peer_dies, make_comm=False, allow_errors=True, timeout=60)
    for result in results[:2]:
        assert result is not None and result[0] != "error", result
        step, message, elapsed = result
        assert step >= 3 and "rank 2" in message, message
        assert elapsed < 10, elapsed


def state_errors(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    with pytest.raises(TypeError, match="hook state must be None, a ringcomm.Communicator"):
        train(rank, hooks.allreduce_hook, state=dist.group.WORLD)
    dist.destroy_process_group()
    return True


def test_bad_state_is_a_clear_error():
    assert all(run_ranks(1, state_errors, make_comm=False))


def default_communicator_follows_default_group(store, rank, world):
    first = []
    for attempt in range(2):
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank, world_size=world
        )
        first.append(train(rank, hooks.allreduce_hook))
        comm = hooks.default_communicator()
        dist.destroy_process_group()
    return torch.equal(first[0], first[1]) and comm.broken is None


def test_default_communicator_is_remade_for_a_new_default_group():
    assert all(run_ranks(2, default_communicator_follows_default_group, make_comm=False))


def train_ddp(*args):
    """examples/train_ddp.py on 2 ranks under torchrun, width 64, 2 epochs: (its output, the
    result rows by run name, the step breakdown's text)."""
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_ddp.py")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        example,
        "--width",
        "64",
        "--epochs",
        "2",
        *args,
    ]
    out = subprocess.run(torchrun, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    results, _, breakdown = out.stdout.partition("step time on rank 0")
    rows = {line[:34].strip(): line[34:].split() for line in results.splitlines() if "%" in line}
    return out, rows, breakdown


def test_train_ddp_example(tmp_path):
    out, rows, breakdown = train_ddp("--backend", "ringcomm", "--hook", "fp16", "--compare-gloo")
    ours, gloo = rows["ringcomm, ringcomm fp16 hook"], rows["gloo, DDP's all-reduce"]
    # the step split into forward, backward compute, waiting, optimizer; the waiting share
    phases = {
        line[:34].strip(): line[34:].split() for line in breakdown.splitlines() if "%" in line
    }
    for name in rows:
        ms, share = [float(v) for v in phases[name][:4]], float(phases[name][4].rstrip("%"))
        assert all(v >= 0 for v in ms) and 0 <= share < 100, out.stdout
    assert "bucket 0:" in breakdown, out.stdout
    assert ours[0] == gloo[0] and float(ours[0].rstrip("%")) > 50, out.stdout  # test accuracy
    # fp16 gradients: half of gloo's float32 bytes on the wire
    assert 0.4 < float(ours[3]) / float(gloo[3]) < 0.6, out.stdout


def test_train_ddp_example_measures_the_limits_of_a_topk_step():
    """--compare-floor with --hook topk: beside the floor and the averaged step's limit, top-k's
    own work with no network, which sends nothing."""
    out, rows, _ = train_ddp("--warmup", "1", "--hook", "topk", "--compare-floor")
    assert set(rows) == {
        "gloo, ringcomm topk hook",
        "no communication (floor)",
        "wait only (sync limit)",
        "wait + local a+b (limit)",
        "top-k, no network (limit)",
    }, out.stdout
    assert float(rows["top-k, no network (limit)"][3]) == 0.0, out.stdout  # MB sent per step
    assert "over top-k, no network (limit)" in out.stdout, out.stdout
