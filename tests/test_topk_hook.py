"""topk_hook: DDP trains with it, its state round-trips, and ratio 1 equals dense averaging."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ranks import run_ranks
from ringcomm.hooks import TopKState, fp16_compress_wrapper, topk_hook


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def digits_batches(rank, world, steps, batch=32):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(len(x), generator=gen)
    for s in range(steps):
        idx = order[(s * world + rank) * batch % (len(x) - batch) :][:batch]
        yield x[idx], y[idx]


def train(store, rank, world, hook_kind, steps):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(make_model(), bucket_cap_mb=0.05)  # several buckets
    state = TopKState(ratio=0.05, dense_steps=2, warmup_steps=4, adaptive=False, schedule="fixed")
    if hook_kind == "topk":
        model.register_comm_hook(state, topk_hook)
    elif hook_kind == "fp16_topk":
        model.register_comm_hook(state, fp16_compress_wrapper(topk_hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, prepared = [], None
    for xb, yb in digits_batches(rank, world, steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if state.step == state.dense_steps:  # the last dense step ended: its prepared blocks
            prepared = {
                block.untyped_storage().data_ptr(): block.numel()
                for block, *_ in state.memory._prepared
            }
        elif state.step == state.dense_steps + 1:  # the first compressed step took them
            carved = {t.untyped_storage().data_ptr() for t in state.residuals.values()}
            assert not state.memory._prepared, "let go after the first compressed step"
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    saved = state.state_dict()
    restored = TopKState()
    restored.load_state_dict(saved)
    round_trip = restored.step == state.step and all(
        torch.equal(restored.residuals[i], t) for i, t in state.residuals.items()
    )
    stats = state.stats
    dist.destroy_process_group()
    return dict(
        losses=losses,
        params=params,
        round_trip=round_trip,
        steps=stats.steps,
        prepared=sum(prepared.values()),
        carved_from_prepared=carved <= set(prepared),
        ratio=stats.compression_ratio,
        compressed=stats.compressed_buckets,
        residual_keys=sorted(state.residuals),
    )


@pytest.mark.parametrize("hook_kind", ["topk", "fp16_topk"])
def test_ddp_trains_with_topk_hook(hook_kind):
    results = run_ranks(2, train, hook_kind, 40, make_comm=False, timeout=180)
    for r in results:
        assert r["round_trip"] and r["steps"] == 40 and r["compressed"] > 0
        assert r["residual_keys"]  # a residual per compressed bucket
        # The first compressed step's residuals are slices of the zeroed memory that the last
        # dense step faulted in while its all-reduce waited (TopKState.prepare_memory), which
        # covered every parameter.
        assert r["carved_from_prepared"]
        assert r["prepared"] == sum(p.numel() for p in make_model().parameters())
        assert r["ratio"] > 3, r["ratio"]  # warm-up steps are dense, the rest ~5%
        assert sum(r["losses"][-5:]) < sum(r["losses"][:5])
    # DDP keeps replicas identical: every rank applied the same averaged update
    assert torch.equal(results[0]["params"], results[1]["params"])


def ratio_one_matches_dense(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(rank)
    grads = [torch.randn(5000), torch.randn(300)]
    state = TopKState(
        ratio=1.0, dense_steps=0, adaptive=False, value_dtype=torch.float32, quantize_whole=False
    )

    outs = [topk_hook(state, Bucket(g.clone(), i, i == 1)).wait() for i, g in enumerate(grads)]
    dense = [g.clone() for g in grads]
    for d in dense:
        dist.all_reduce(d)
        d /= world
    ok = all(torch.allclose(o, d, atol=1e-6) for o, d in zip(outs, dense))
    residual_zero = all(bool((r == 0).all()) for r in state.residuals.values())
    dist.destroy_process_group()
    return ok and residual_zero and state.step == 1


class Bucket:  # what DDP passes a hook: buffer(), index(), is_last(), parameters()
    """`parameter`: the bucket's one parameter, the same object from step to step as under DDP,
    so that the memory a compressor keeps for it (residual, velocity), which follows it, is kept;
    None: the gradient itself, a new object each step."""

    def __init__(self, t, i, last, parameter=None):
        self.t, self.i, self.last, self.parameter = t, i, last, parameter

    def buffer(self):
        return self.t

    def index(self):
        return self.i

    def is_last(self):
        return self.last

    def parameters(self):
        return [self.t if self.parameter is None else self.parameter]

    def gradients(self):
        return [self.t]


def adaptive_buckets(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(rank)
    grads = [torch.randn(1000), torch.randn(200_000)]
    state = TopKState(dense_steps=0, warmup_steps=0, schedule="fixed")  # adaptive by default
    outs = [topk_hook(state, Bucket(g.clone(), i, i == 1)).wait() for i, g in enumerate(grads)]
    dense = grads[0].clone()
    dist.all_reduce(dense)
    dense /= world
    small_exact = torch.allclose(outs[0], dense, atol=1e-6)
    nonzero = int((outs[1] != 0).sum())
    dist.destroy_process_group()
    return small_exact, nonzero, state.stats.dense_buckets, state.stats.compressed_buckets


def test_adaptive_sends_small_buckets_dense_and_large_ones_sparse():
    for small_exact, nonzero, dense, compressed in run_ranks(2, adaptive_buckets, make_comm=False):
        assert small_exact and (dense, compressed) == (1, 1)
        assert 2000 <= nonzero <= 4000  # 1% from each of 2 ranks, their union


def test_ratio_one_is_dense_averaging():
    assert all(run_ranks(3, ratio_one_matches_dense, make_comm=False))


def test_state_validates_its_arguments():
    with pytest.raises(ValueError, match="ratio"):
        TopKState(ratio=0)
    with pytest.raises(TypeError, match="value_dtype"):
        TopKState(value_dtype=torch.int8)
    with pytest.raises(ValueError, match="warmup_density"):
        TopKState(warmup_density=1.5)
    with pytest.raises(ValueError, match="clip_norm"):
        TopKState(clip_norm=0)


def test_sparsity_warmup_divides_the_density_by_four_per_stage():
    # Deep Gradient Compression's schedule: 75%, 93.75%, 98.4%, 99.6%, then the target
    state = TopKState(ratio=0.001, dense_steps=1, warmup_steps=8, warmup_density=0.25)
    assert [state.density(s) for s in range(11)] == [
        1.0,
        0.25,
        0.25,
        0.0625,
        0.0625,
        0.015625,
        0.015625,
        0.00390625,
        0.00390625,
        0.001,
        0.001,
    ]
    assert [TopKState(ratio=0.3, dense_steps=0, warmup_steps=5).density(s) for s in (0, 4, 5)] == [
        0.3,
        0.3,
        0.3,
    ]  # a target above the first stage: no ramp
    assert TopKState(warmup_steps=0, dense_steps=0).density(0) == 0.01


def test_take_momentum_moves_sgd_momentum_into_the_state():
    params = [nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.8)
    state = TopKState()
    state.take_momentum(opt)
    assert state.momentum_correction and state.momentum == 0.8
    assert opt.param_groups[0]["momentum"] == 0
    for bad in (
        dict(momentum=0.9, nesterov=True),
        dict(momentum=0.9, weight_decay=1e-4),
        dict(momentum=0),
    ):
        with pytest.raises(ValueError, match="momentum"):
            TopKState().take_momentum(torch.optim.SGD(params, lr=0.1, **bad))


def costs_on_every_rank(comm):
    sizes = [
        (100, 1),
        (16_000, 160),
        (4_000_000, 40_000),
        (4_000_000, 1_000_000),
        (4_000_000, 4_000_000),
    ]
    return [comm.compression_costs(n, k, torch.bfloat16) for n, k in sizes]


def test_compression_costs_choose_dense_for_small_or_dense_buckets():
    results = run_ranks(4, costs_on_every_rank)
    assert all(r == results[0] for r in results)  # every rank makes the same choice
    (
        (tiny_sparse, tiny_dense),
        (small_sparse, small_dense),
        (big_sparse, big_dense),
        (quarter_sparse, quarter_dense),
        (all_sparse, all_dense),
    ) = results[0]
    assert tiny_dense < tiny_sparse  # one recursive-doubling all-reduce beats two exchanges
    assert small_dense < small_sparse  # 64 KB: recursive doubling, latency-bound either way
    assert big_sparse < big_dense / 20  # 1%: a small fraction of the ring's bytes
    assert quarter_sparse < quarter_dense  # 25% with bf16 values and varint indices still pays
    assert all_dense < all_sparse


def averager_with_topk(comm, ratio):
    import ringcomm

    torch.manual_seed(0)
    model = make_model()
    state = TopKState(
        ratio=ratio,
        dense_steps=1,
        warmup_steps=0,
        adaptive=False,
        value_dtype=torch.float32,
        schedule="fixed",
    )
    averager = ringcomm.GradientAverager(
        model.parameters(), comm, bucket_bytes=40_000, compression=state
    )
    grads_seen = []
    for xb, yb in digits_batches(comm.rank, comm.world_size, 3):
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        local = [p.grad.clone() for p in model.parameters()]
        averager.step()
        grads_seen.append(([p.grad.clone() for p in model.parameters()], local))
    averager.remove()
    return grads_seen, state.step, state.stats.compressed_buckets, len(averager.buckets)


def test_gradient_averager_with_topk_state():
    # ratio 1: after the dense warm-up step, top-k sends everything: the plain average again
    results = run_ranks(2, averager_with_topk, 1.0)
    for _grads_seen, steps, compressed, n_buckets in results:
        assert steps == 3 and n_buckets > 1 and compressed == 2 * n_buckets
    for step in range(3):
        locals_ = [r[0][step][1] for r in results]
        expect = [(a + b) / 2 for a, b in zip(*locals_)]
        for grads_seen, *_ in results:
            for got, want in zip(grads_seen[step][0], expect):
                assert torch.allclose(got, want, atol=1e-6)
    # ratio 5%: every rank ends with the same (compressed) average
    results = run_ranks(2, averager_with_topk, 0.05)
    for step in range(3):
        for a, b in zip(results[0][0][step][0], results[1][0][step][0]):
            assert torch.equal(a, b)


def clipped_average(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    grad = torch.full((1000,), 10.0 * (rank + 1))
    state = TopKState(
        ratio=1.0, dense_steps=0, adaptive=False, value_dtype=torch.float32, clip_norm=2.0
    )
    out = topk_hook(state, Bucket(grad, 0, True)).wait()
    dist.destroy_process_group()
    return out


def test_clip_norm_scales_each_ranks_gradient_before_averaging():
    # each rank's gradient is scaled to norm 2 / sqrt(2) before the average
    for out in run_ranks(2, clipped_average, make_comm=False):
        assert torch.allclose(out, torch.full((1000,), 2.0 / 2**0.5 / 1000**0.5), atol=1e-6)


def momentum_in_hook_or_optimizer(store, rank, world, taken):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TopKState(dense_steps=1000)  # every step dense: momentum correction is then exact
    if taken:
        state.take_momentum(opt)
    model.register_comm_hook(state, topk_hook)
    for xb, yb in digits_batches(rank, world, 8):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.destroy_process_group()
    return params


def test_take_momentum_on_dense_steps_is_sgd_momentum():
    # The hook averaging each rank's velocity, then plain SGD, is SGD momentum on the average.
    in_optimizer = run_ranks(2, momentum_in_hook_or_optimizer, False, make_comm=False)[0]
    in_hook = run_ranks(2, momentum_in_hook_or_optimizer, True, make_comm=False)[0]
    assert not torch.equal(in_optimizer, make_model_params())
    assert torch.allclose(in_hook, in_optimizer, atol=1e-5)


def make_model_params():
    return torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])


# -- the signal schedule --------------------------------------------------------------------------


def done():  # the energies are in, as they are by the next step
    return True


def feed(state, slot, signal, gradient=1.0):
    """One step of the signal schedule for `slot`: the density it decides, after an exchange
    that then measures summed energies with density * residual / gradient = `signal`."""
    density = state._level_density(slot)
    residual = signal * gradient / density
    state.levels[slot].measured = (done, torch.tensor([residual, gradient]), density)
    return density


def test_signal_schedule_sparsifies_as_training_and_error_feedback_settle():
    state = TopKState(ratio=0.01)
    assert state.ladder() == [1.0, 0.0625, 0.015625, 0.01]
    # a steady gradient, a residual of noise (signal about 1/6): whole until WINDOW steps were
    # calm, then a level sparser after 1 / density steps at each
    densities = [feed(state, 0, 1 / 6) for _ in range(110)]
    assert densities == [1.0] * 16 + [0.0625] * 16 + [0.015625] * 64 + [0.01] * 14


def test_signal_schedule_goes_denser_while_the_gradient_changes_or_is_held_back():
    state = TopKState(ratio=0.01)
    # the gradient's energy growing 8% a step: critical, whole throughout
    assert {feed(state, 0, 0.1, 1.08**t) for t in range(60)} == {1.0}
    # then steady: sparser once calm for WINDOW steps
    densities = [feed(state, 0, 0.1, 1.08**60) for _ in range(40)]
    assert densities[-1] == 0.0625
    # the energy falls to a third (a learning rate decay): the smoothed energy takes 15 steps to
    # move by critical_change (meanwhile 6.25% has settled), then the bucket goes a level denser
    densities = [feed(state, 0, 0.1, 1.08**60 / 3) for _ in range(18)]
    assert densities == [0.0625] * 13 + [0.015625] * 4 + [0.0625]
    # critical again (growing 8% a step): whole again; without return_whole, having gone sparse,
    # 6.25% is the densest it goes
    kept = TopKState(ratio=0.01, return_whole=False)
    kept.load_state_dict(state.state_dict() | {"return_whole": False})
    again = [feed(state, 0, 0.1, 1.08 ** (60 + t) / 3) for t in range(40)]
    assert again[-1] == 1.0, again
    densities = [feed(kept, 0, 0.1, 1.08 ** (60 + t) / 3) for t in range(40)]
    assert 1.0 not in densities and densities[-1] == 0.0625, densities
    assert kept.levels[0].sparse and kept.levels[0].calm == 0
    # a residual holding gradient back (signal 5 > residual_limit 1) keeps it denser too
    state = TopKState(ratio=0.01, critical_change=1e9)
    assert {feed(state, 1, 5.0) for _ in range(100)} == {1.0}
    # a state saved and loaded keeps each slot's level and signals
    restored = TopKState()
    restored.load_state_dict(state.state_dict())
    assert restored.levels[1].saved() == state.levels[1].saved()


def signal_schedule_on_ranks(store, rank, world, steps):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(make_model(), bucket_cap_mb=0.05)
    # every settled level goes sparser
    state = TopKState(ratio=0.01, residual_limit=1e9, critical_change=1e9)
    model.register_comm_hook(state, topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for xb, yb in digits_batches(rank, world, steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        history.append(dict(state.stats.densities))
    saved = {slot: lv.saved() for slot, lv in state.levels.items()}
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.destroy_process_group()
    return history, saved, params, dict(state.stats.dense_reasons)


def test_signal_schedule_decides_alike_on_every_rank():
    results = run_ranks(3, signal_schedule_on_ranks, 22, make_comm=False, timeout=180)
    history, saved, params, reasons = results[0]
    for r in results:
        assert r[0] == history and r[1] == saved  # the same densities and signals, bit for bit
        assert torch.equal(r[2], params)
    assert set(history[0].values()) == {1.0}  # the dense step, then whole while not yet calm
    assert set(history[16].values()) == {1.0} and set(history[-1].values()) == {0.0625}
    assert reasons["whole as 8-bit codes: critical regime"] > 0


# -- the same weights whatever the load at start ------------------------------------------------


def topk_training(store, rank, world, steps, schedule):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(make_model(), bucket_cap_mb=0.02)  # buckets from 2.6K to 16K elements
    # "fixed": top-k from the second step; "signal": whole as 8-bit codes over these steps
    state = TopKState(ratio=0.05, schedule=schedule)
    model.register_comm_hook(state, topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for xb, yb in digits_batches(rank, world, steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    from ringcomm.hooks import default_communicator

    link = default_communicator().link_model()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    stats = state.stats
    dist.destroy_process_group()
    return params, link["alpha_s"], dict(stats.dense_reasons), stats.compressed_buckets


@pytest.mark.parametrize("schedule", ["fixed", "signal"])
def test_topk_training_started_under_a_cpu_hog_ends_with_the_same_weights(schedule):
    import subprocess
    import sys

    env = {"RINGCOMM_TUNING": ""}  # the default: the link model probed at connect
    quiet = run_ranks(3, topk_training, 12, schedule, make_comm=False, timeout=240, env=env)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = run_ranks(3, topk_training, 12, schedule, make_comm=False, timeout=240, env=env)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    for q, b in zip(quiet, busy):
        assert torch.equal(q[0], b[0])  # every rank's weights, bit for bit
        assert q[2:] == b[2:]  # the same buckets went whole
    if schedule == "fixed":
        assert quiet[0][3] > 0  # compressed
    else:
        assert quiet[0][2]["whole as 8-bit codes: critical regime"] > 0
    # the probe did time the machine differently: nothing of it reached the weights
    assert quiet[0][1] != busy[0][1]


def dense_bucket_logged(store, rank, world):
    import logging

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("ringcomm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    state = TopKState(dense_steps=1, warmup_steps=0, schedule="fixed")
    grads = [torch.randn(100), torch.randn(200_000)]
    for _ in range(3):
        for i, g in enumerate(grads):
            topk_hook(state, Bucket(g.clone(), i, i == 1)).wait()
    signal = TopKState(dense_steps=0)  # starts whole, as 8-bit codes
    topk_hook(signal, Bucket(grads[1].clone(), 1, True)).wait()
    lines.append(signal.stats.dense_reasons)
    from ringcomm.hooks import default_communicator

    buckets = default_communicator().stats()["buckets"]
    dist.destroy_process_group()
    return lines, state.stats, buckets


def test_a_bucket_sent_whole_says_so_in_stats_and_at_info():
    lines, stats, buckets = run_ranks(2, dense_bucket_logged, make_comm=False)[0]
    # step 0 both whole (dense steps); then the small one whole by the cost model, the large one
    # compressed: each change of way logged once
    assert stats.dense_reasons == {"dense steps": 2, "its dense all-reduce costs no more": 2}
    assert stats.compressed_buckets == 2 and stats.densities == {0: 1.0, 1: 0.01}
    assert buckets[0]["dense"] == 3 and buckets[1]["dense"] == 2  # + the signal schedule's
    assert lines == [
        "TopKState: bucket 0 (100 float32 elements) goes whole (dense steps) from step 0",
        "TopKState: bucket 1 (200,000 float32 elements) goes whole (dense steps) from step 0",
        "TopKState: bucket 0 (100 float32 elements) goes whole (its dense all-reduce costs no "
        "more) from step 1",
        "TopKState: bucket 1 (200,000 float32 elements) is compressed from step 1",
        "TopKState: bucket 1 (200,000 float32 elements) goes whole (whole as 8-bit codes: critical "
        "regime) from step 0",
        {"whole as 8-bit codes: critical regime": 1},
    ], lines


def small_and_large_buckets(store, rank, world, share, sizes):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(rank)
    state = TopKState(whole_share=share, adaptive=False)
    grads = [torch.randn(n) for n in sizes]
    for _ in range(6):
        for i, g in enumerate(grads):
            topk_hook(state, Bucket(g.clone(), i, i == len(grads) - 1)).wait()
    restored = TopKState()
    restored.load_state_dict(state.state_dict())
    dist.destroy_process_group()
    return dict(state.stats.dense_reasons), sorted(state.levels), sorted(restored._small)


def test_the_smallest_buckets_stay_whole():
    # 2% and 98% of a step: at 5% the small one is whole from the step after the dense one (5
    # steps), the large one whole by the schedule's start; at 1% both by the schedule
    both = {"dense steps": 2, "whole as 8-bit codes: critical regime": 10}
    for share, sizes, reasons, scheduled, small in (
        (
            0.05,
            [2_000, 98_000],
            {
                "dense steps": 2,
                "whole as 8-bit codes: a small bucket": 5,
                "whole as 8-bit codes: critical regime": 5,
            },
            [1],
            [0],
        ),
        (0.01, [2_000, 98_000], both, [0, 1], []),
        # ten equal buckets of 10% each: none fits 5% of the step, so none is kept whole
        (
            0.05,
            [10_000] * 10,
            {"dense steps": 10, "whole as 8-bit codes: critical regime": 50},
            list(range(10)),
            [],
        ),
        # the smallest first, while together within 25%: 5% + 10% + 10%
        (0.25, [5_000, 10_000, 10_000, 75_000], None, [3], [0, 1, 2]),
    ):
        for got in run_ranks(2, small_and_large_buckets, share, sizes, make_comm=False):
            if reasons is not None:
                assert got[0] == reasons, (share, sizes, got)
            assert got[1:] == (scheduled, small), (share, sizes, got)
