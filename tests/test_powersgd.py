"""powersgd_hook and PowerSGDState: DDP on gloo and on the ringcomm backend (and compiled DDP)
trains with it, its state round-trips, full rank equals dense averaging, error feedback loses
nothing, GradientAverager takes it, a rank that fails mid-step fails the others, and torch's own
hook's failure on gloo is not ours."""

import io
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm
from ranks import run_ranks
from ringcomm.hooks import PowerSGDState, fp16_compress_wrapper, powersgd_hook
from ringcomm.hooks import powersgd as powersgd_module


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def digits_batches(rank, world, steps, batch=32, start=0):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(len(x), generator=gen)
    for s in range(start, start + steps):
        idx = order[(s * world + rank) * batch % (len(x) - batch) :][:batch]
        yield x[idx], y[idx]


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_steps(model, opt, rank, world, steps, start=0):
    losses = []
    for xb, yb in digits_batches(rank, world, steps, start=start):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_training(store, rank, world, backend, hook_kind, comm_kind):
    """30 steps of DDP with powersgd_hook; then, from a checkpoint taken at step 20, the last 10
    again with a fresh state loaded from state_dict() (and once with a fresh state that only knows
    the step, to show the memory matters)."""
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    model = DDP(make_model(), bucket_cap_mb=0.05)  # several buckets
    comm = dist.group.WORLD if comm_kind == "group" else None
    state = PowerSGDState(matrix_approximation_rank=2, start_iter=3, comm=comm)
    holder = {"state": state}

    def hook(holder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return inner(holder["state"], bucket)

    inner = fp16_compress_wrapper(powersgd_hook) if hook_kind == "fp16" else powersgd_hook
    model.register_comm_hook(holder, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train_steps(model, opt, rank, world, 20)
    checkpoint = ({k: v.clone() for k, v in model.module.state_dict().items()}, state.state_dict())
    losses += train_steps(model, opt, rank, world, 10, start=20)
    uninterrupted = flat_params(model)
    stats = state.stats

    buf = io.BytesIO()
    torch.save(checkpoint[1], buf)  # a checkpoint file: torch.load's weights_only default
    buf.seek(0)
    saved = torch.load(buf)
    resumed = {}
    for kind in ("loaded", "step only"):
        model.module.load_state_dict(checkpoint[0])
        fresh = PowerSGDState(comm=comm)
        if kind == "loaded":
            fresh.load_state_dict(saved)
        else:
            fresh.matrix_approximation_rank, fresh.start_iter, fresh.step = 2, 3, saved["step"]
        holder["state"] = fresh
        train_steps(model, opt, rank, world, 10, start=20)
        resumed[kind] = flat_params(model)
    dist.destroy_process_group()
    return dict(
        losses=losses,
        params=uninterrupted,
        resumed=resumed["loaded"],
        step_only=resumed["step only"],
        steps=stats.steps,
        ratio=stats.compression_ratio,
        compressed=stats.compressed_tensors,
        dense=stats.dense_tensors,
        memory_slots=sorted(state.factors),
    )


@pytest.mark.parametrize(
    "backend,hook_kind,comm_kind",
    [
        ("gloo", "fp32", "default"),
        ("gloo", "fp16", "default"),
        ("ringcomm", "fp32", "default"),
        ("ringcomm", "fp32", "group"),
    ],
)
def test_ddp_trains_with_powersgd_hook(backend, hook_kind, comm_kind):
    results = run_ranks(
        2, ddp_training, backend, hook_kind, comm_kind, make_comm=False, timeout=120
    )
    for r in results:
        assert r["steps"] == 30 and r["compressed"] == 2 * 27, r  # two weight matrices a step
        assert r["memory_slots"], r  # error and Q kept per bucket
        assert r["ratio"] > 5, r["ratio"]  # 3 dense steps, then ~(n+m)2 of n m values
        assert sum(r["losses"][-5:]) < 0.9 * sum(r["losses"][:5]), r["losses"]  # dense: 0.83
        # a state loaded from state_dict() continues exactly as the uninterrupted one
        assert torch.equal(r["resumed"], r["params"])
        assert not torch.equal(r["step_only"], r["params"])  # without the memory: not the same
    # DDP keeps replicas identical: every rank applied the same averaged update
    assert torch.equal(results[0]["params"], results[1]["params"])


class Bucket:
    """What DDP passes: buffer(), gradients() (views of the buffer), parameters(), index(),
    is_last()."""

    def __init__(self, shapes, values, index, last):
        self.flat = torch.cat([v.reshape(-1) for v in values])
        self.shapes, self.i, self.last = shapes, index, last

    def buffer(self):
        return self.flat

    def gradients(self):
        out, offset = [], 0
        for shape in self.shapes:
            n = torch.Size(shape).numel()
            out.append(self.flat[offset : offset + n].view(shape))
            offset += n
        return out

    def parameters(self):
        return self.gradients()  # one parameter per gradient

    def index(self):
        return self.i

    def is_last(self):
        return self.last


BUCKETS = [[(8, 3, 3, 3), (8,), (20, 30)], [(40, 5), (7,), (6, 50)]]


def full_rank_matches_dense(comm, rank_r, steps):
    """Random gradients through powersgd_hook (fake buckets, then compiled DDP's tuples): with
    rank >= min(n, m) every step's result is the dense average. At any rank, error feedback
    loses nothing: the results summed over the steps, plus the ranks' mean error left over, are
    the dense averages summed."""
    state = PowerSGDState(
        matrix_approximation_rank=rank_r, start_iter=2, min_compression_rate=0, comm=comm
    )
    gen = torch.Generator().manual_seed(comm.rank)
    worst = 0.0
    sums = [[0, 0] for _ in BUCKETS]  # per bucket: results, dense averages
    for _ in range(steps):
        grads = [[torch.randn(s, generator=gen) for s in shapes] for shapes in BUCKETS]
        futures = [
            powersgd_hook(state, Bucket(shapes, g, i, i == len(BUCKETS) - 1))
            for i, (shapes, g) in enumerate(zip(BUCKETS, grads))
        ]
        outs = [f.wait() for f in futures]
        for out, g, total in zip(outs, grads, sums):
            dense = torch.cat([t.reshape(-1) for t in g])
            comm.all_reduce(dense, op="avg")
            worst = max(worst, float((out - dense).abs().max()))
            total[0], total[1] = total[0] + out, total[1] + dense
    lost = 0.0
    for i, (shapes, (results, averages)) in enumerate(zip(BUCKETS, sums)):
        error = torch.zeros_like(results)  # the bucket's error, zero for what went whole
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + torch.Size(shape).numel())
        memory = state.factors[i].error
        e = 0
        for t, n, m, _ in powersgd_module._plan(tuple(shapes), rank_r, 0.0, True).matrices:
            error[offsets[t] : offsets[t] + n * m] = memory[e : e + n * m]
            e += n * m
        comm.all_reduce(error, op="avg")
        lost = max(lost, float((results + error - averages).abs().max()))
    hook_steps, compressed = state.step, state.stats.compressed_tensors

    # compiled DDP: one (grad, param) per call, written in place
    state = PowerSGDState(
        matrix_approximation_rank=rank_r, start_iter=0, min_compression_rate=0, comm=comm
    )
    params = [nn.Parameter(torch.zeros(s)) for shapes in BUCKETS for s in shapes]
    tuple_worst = 0.0
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=gen)
            dense = grad.clone()
            comm.all_reduce(dense, op="avg")
            fut = powersgd_hook(state, (grad, p))
            assert fut.done() and fut.value() is grad
            tuple_worst = max(tuple_worst, float((grad - dense).abs().max()))
    return worst, lost, hook_steps, compressed, tuple_worst, state.step


@pytest.mark.parametrize("world", [2, 3])
def test_full_rank_is_dense_averaging_and_error_feedback_loses_nothing(world):
    for worst, lost, steps, compressed, tuple_worst, tuple_steps in run_ranks(
        world, full_rank_matches_dense, 50, 5
    ):
        assert steps == 5 and compressed == 3 * 4  # 4 matrices in each of the 3 compressed steps
        assert worst < 1e-5 and tuple_worst < 1e-5 and lost < 1e-5, (worst, tuple_worst, lost)
        assert tuple_steps == 4  # the 5th step ends when its first parameter comes round again
    # rank 1: each step only an approximation (so the check above can fail), but what it missed
    # is in the error memory, to the last bit of rounding
    for worst, lost, *_ in run_ranks(world, full_rank_matches_dense, 1, 5):
        assert worst > 0.1 and lost < 1e-5, (worst, lost)


def compiled_ddp(store, rank, world):
    """torch.compile'd DDP with compiled autograd: DDP's python reducer calls the hook once per
    parameter with (grad, param), synchronously. The hook is registered as ringcomm.hooks says to
    under torch.compile, kept out of dynamo: no graph it compiles holds ringcomm's code."""
    import torch._dynamo

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    model = make_model()
    ddp = DDP(model)
    state = PowerSGDState(start_iter=2)
    ddp.register_comm_hook(state, torch.compiler.disable(powersgd_hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = []  # where each operation in the graphs that dynamo compiled comes from

    def recording_backend(graph, example_inputs):  # dynamo without inductor's C++ compile: fast
        traced.extend(node.meta.get("stack_trace") or "" for node in graph.graph.nodes)
        return graph.forward

    @torch.compile(backend=recording_backend)
    def backward(xb, yb):
        nn.functional.cross_entropy(ddp(xb), yb).backward()

    for xb, yb in digits_batches(rank, world, 6):
        opt.zero_grad()
        backward(xb, yb)
        opt.step()
    in_ringcomm = sum(os.path.join("ringcomm", "hooks", "") in trace for trace in traced)
    return (
        state.step,
        state.stats.compressed_tensors,
        sorted(state.factors),
        flat_params(model),
        len(traced),
        in_ringcomm,
    )


def test_compiled_ddp_tuples():
    results = run_ranks(2, compiled_ddp, make_comm=False, timeout=120)
    for steps, compressed, slots, _, traced, in_ringcomm in results:
        # the 6th step ends when its first parameter comes round again; memory per weight
        assert steps == 5 and compressed == 2 * 4 and len(slots) == 2, (steps, compressed, slots)
        assert traced > 0 and in_ringcomm == 0, (traced, in_ringcomm)
    assert torch.equal(results[0][3], results[1][3])


def averager_with_powersgd(comm, rank_r):
    torch.manual_seed(0)
    model = make_model()
    extra = nn.Linear(64, 32)  # used on rank 0 only: rank 1 has no gradient for it
    params = list(model.parameters()) + list(extra.parameters())
    state = PowerSGDState(matrix_approximation_rank=rank_r, start_iter=1, min_compression_rate=0)
    averager = ringcomm.GradientAverager(params, comm, bucket_bytes=40_000, compression=state)
    seen = []
    for xb, yb in digits_batches(comm.rank, comm.world_size, 4):
        for p in params:
            p.grad = None
        loss = nn.functional.cross_entropy(model(xb), yb)
        if comm.rank == 0:
            loss = loss + extra(xb).square().mean()
        # this rank's own gradients, taken first: once backward starts a bucket, its gradients
        # are rewritten in the background (error feedback, then the average)
        own = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        local = [torch.zeros_like(p) if g is None else g for p, g in zip(params, own)]
        loss.backward()
        averager.step()
        seen.append(([p.grad.clone() for p in params], local))
    averager.remove()
    return seen, state.step, state.stats.compressed_tensors, len(averager.buckets)


def test_gradient_averager_with_powersgd_state():
    results = run_ranks(2, averager_with_powersgd, 1000)  # full rank: the plain average again
    for _seen, steps, compressed, n_buckets in results:
        assert steps == 4 and n_buckets > 1 and compressed == 3 * 3  # 3 weights, 3 steps
    for step in range(4):
        expect = [(a + b) / 2 for a, b in zip(results[0][0][step][1], results[1][0][step][1])]
        for seen, *_ in results:
            for got, want in zip(seen[step][0], expect):
                assert torch.allclose(got, want, atol=1e-5)
    results = run_ranks(2, averager_with_powersgd, 1)  # rank 1: the same approximation everywhere
    for step in range(4):
        for a, b in zip(results[0][0][step][0], results[1][0][step][0]):
            assert torch.equal(a, b)


def failing_rank(store, rank, world, where):
    """Rank 1 raises inside PowerSGD at step 4: while preparing a bucket (on the calling thread)
    or after P's all-reduce (in the completion callback, on the progress thread)."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(make_model(), bucket_cap_mb=0.05)
    state = PowerSGDState(start_iter=2)
    model.register_comm_hook(state, powersgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    original = powersgd_module._orthonormalize
    rows = {"prepare": 64, "callback": 10}[where]  # Q of the first layer, P of the last

    def orthonormalize(matrix):
        if rank == 1 and state.step == 4 and matrix.shape[0] == rows:
            raise RuntimeError("injected failure")
        return original(matrix)

    powersgd_module._orthonormalize = orthonormalize
    for step, (xb, yb) in enumerate(digits_batches(rank, world, 8)):
        start = time.monotonic()
        try:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        except Exception as e:  # noqa: BLE001
            return step, str(e), time.monotonic() - start
    return None


@pytest.mark.parametrize("where", ["prepare", "callback"])
def test_a_rank_failing_mid_step_fails_the_others_at_once(where):
    # the hook's communicator has a 10 minute timeout: only the abort can end rank 0's wait soon
    (step0, message0, elapsed0), (step1, message1, _) = run_ranks(
        2, failing_rank, where, make_comm=False, timeout=60
    )
    assert step0 == step1 == 4
    assert "injected failure" in message1, message1
    assert "PowerSGD failed on rank 1" in message0 and "injected failure" in message0, message0
    # rank 1 aborted its communicator: rank 0 raises that kind, RingcommError's AbortedError
    assert "AbortedError" in message0 and "Unable to cast" not in message0, message0
    assert elapsed0 < 10, elapsed0


def test_state_and_hook_validate_their_arguments():
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDState(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_iter"):
        PowerSGDState(start_iter=-1)
    bucket = Bucket([(4, 4)], [torch.ones(4, 4)], 0, True)
    with pytest.raises(ValueError, match="start_iter must be >= 2"):
        powersgd_hook(PowerSGDState(start_iter=1), bucket)
    with pytest.raises(TypeError, match="PowerSGDState"):
        powersgd_hook(None, bucket)
    with pytest.raises(ValueError, match="PowerSGDState"):
        ringcomm.GradientAverager([nn.Parameter(torch.ones(2))], None, compression="powersgd")
    PowerSGDState().check_device(torch.device("cuda", 0))  # CUDA gradients: averaged there


def test_orthonormalize_is_deterministic_and_survives_dependent_columns():
    gen = torch.Generator().manual_seed(0)
    original = torch.randn(50, 4, generator=gen)
    original[:, 2] = original[:, 0] * 3 - original[:, 1]  # dependent
    original[:, 3] = 0
    original[7] = 0  # a zero row (a dead unit), as in P
    a, b = original.clone(), original.clone()
    powersgd_module._orthonormalize(a)
    powersgd_module._orthonormalize(b)
    assert torch.equal(a, b)
    assert torch.allclose(a.t() @ a, torch.eye(4), atol=1e-6)  # still 4 orthonormal columns
    independent = original[:, :2]
    assert torch.allclose(a @ (a.t() @ independent), independent, atol=1e-5)  # same span
    square = torch.zeros(6, 6)  # zero rows and columns: an orthonormal basis all the same
    square[:3, :3] = torch.randn(3, 3, generator=gen)
    powersgd_module._orthonormalize(square)
    assert torch.allclose(square.t() @ square, torch.eye(6), atol=1e-6)


def torch_hook_then_ours(store, rank, world, which, steps):
    """DDP on gloo with two buckets, start_powerSGD_iter=2 (the earliest torch allows)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=5)
    )
    model = DDP(make_model(), bucket_cap_mb=0.001)
    if which == "torch":
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        model.register_comm_hook(state, torch_psgd.powerSGD_hook)
    else:
        model.register_comm_hook(
            PowerSGDState(matrix_approximation_rank=1, start_iter=2), powersgd_hook
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # torch's hook may also deadlock (its callbacks wait inside gloo's worker threads, with no
    # timeout): a rank still training after 10 s exits, and run_ranks reports it
    deadline = threading.Timer(10, os._exit, args=(7,))
    deadline.start()
    train_steps(model, opt, rank, world, steps)
    deadline.cancel()
    return flat_params(model)


def test_torch_powersgd_hook_fails_on_gloo_where_ours_trains():
    """Shows torch's failure, not ours: torch's powerSGD_hook issues the next all-reduce of a
    bucket from the completion callback of its previous one, which gloo runs on its worker
    thread, while the main thread goes on issuing the next bucket's first all-reduce. The ranks
    interleave the two differently, gloo pairs collectives by issue order, and a 10-element
    all-reduce meets a 256-element one: "Received data size doesn't match expected size" (an
    uncaught gloo exception: the process aborts), or a wait that times out. powersgd_hook issues
    a bucket's first all-reduce only after the previous bucket issued its last, so the order is
    the same everywhere (without that chain it fails the same way here: "mismatched
    operations", checked by hand)."""
    results = run_ranks(
        2, torch_hook_then_ours, "torch", 10, make_comm=False, allow_errors=True, timeout=40
    )
    failures = [r[1] for r in results if isinstance(r, tuple) and r[0] == "error"]
    assert failures, "torch's powerSGD_hook trained on gloo: has torch fixed its ordering?"
    ours = run_ranks(2, torch_hook_then_ours, "ours", 10, make_comm=False, timeout=60)
    assert torch.equal(ours[0], ours[1])
