"""ringcomm.Communicator with CUDA tensors on its device path (ringcomm.device): 2 ranks on one
GPU over CUDA IPC. all_reduce against exact sums, on the default stream and on another; the
stream semantics of ProcessGroupNCCL (the operation after the work on the caller's current
stream, the host never blocked, wait() and the CUDA-aware future ordering the current stream
after it, the tensor's memory held until the operation ends); DDP with the dense, fp16 and bf16
hooks and GradientAverager training on CUDA with no byte staged to the host; and the staged path
where the device path is turned off, logged once."""

import copy
import logging
import time

import torch
import torch.distributed as dist

from ranks import run_ranks

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Elements: none, one, odd, past the one-shot sizes, and several board rounds (20 MiB as float32).
SIZES = [0, 1, 999, (1 << 20) + 3, 5 << 20]
SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second at the H100's and H200's clocks


def values(case, rank, n, dtype):
    """Small integers: every sum of a few of them is exact in every dtype, in any order."""
    gen = torch.Generator().manual_seed(1009 * case + rank)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def exact(case, world, n, dtype, op):
    stacked = torch.stack([values(case, r, n, dtype).double() for r in range(world)])
    reduced = {
        "sum": stacked.sum(0),
        "avg": stacked.sum(0) / world,
        "min": stacked.min(0).values,
        "max": stacked.max(0).values,
    }[op]
    return reduced.to(dtype)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def recording():
    records = Records()
    log = logging.getLogger("ringcomm")
    log.setLevel(logging.INFO)
    log.addHandler(records)
    return records


def all_reduce_rank(comm):
    from ringcomm import staging

    torch.cuda.set_device(0)
    records = recording()
    world, case = comm.world_size, 0
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for dtype in DTYPES:
                for op in ("sum", "avg", "max"):
                    for n in SIZES:
                        for async_op in (False, True):
                            case += 1
                            t = values(case, comm.rank, n, dtype).cuda()
                            work = comm.all_reduce(t, op=op, async_op=async_op)
                            if async_op:
                                work.wait()
                            got = t.cpu()  # a copy on the current stream, after the wait
                            assert torch.equal(got, exact(case, world, n, dtype, op)), (
                                str(stream),
                                dtype,
                                op,
                                n,
                                async_op,
                            )
    assert comm.stats()["device"] == {"cuda:0": "cuda_ipc"}, comm.stats()["device"]
    assert staging.bytes_to_host() == 0
    assert not [line for line in records.lines if "stages CUDA tensors" in line], records.lines
    return True


def test_all_reduce_of_cuda_tensors_on_the_device_path():
    assert all(run_ranks(2, all_reduce_rank, timeout=300, comm_timeout=60))


def stream_rank(comm):
    torch.cuda.set_device(0)
    rank, world = comm.rank, comm.world_size
    n = 1 << 20
    warm = torch.ones(8, device="cuda")
    comm.all_reduce(warm)  # makes the device path: a collective, out of the timings below
    torch.cuda.synchronize()
    t = torch.full((n,), float(rank + 1), device="cuda")
    dropped = torch.ones(n, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy for about a second...
    t.fill_(10.0 * (rank + 1))  # ...then writes the input the all-reduce must read
    start = time.monotonic()
    work = comm.all_reduce(t, async_op=True)
    issued = time.monotonic() - start
    pending = not work.is_completed()
    ptr = dropped.data_ptr()
    comm.all_reduce(dropped, async_op=True)
    del dropped  # and its Work: the operation still holds the memory, which a new tensor of
    other = torch.zeros(n, device="cuda")  # the size on the current stream must not take yet
    reused_early = other.data_ptr() == ptr
    work.wait()
    waited = time.monotonic() - start
    total = 10.0 * world * (world + 1) / 2
    got = t.cpu()  # on the current stream, after the wait: blocks until the GPU is done
    done_after = work.is_completed()
    future = work.get_future()
    doubled = future.then(lambda fut: fut.value() * 2).wait()
    return {
        "issued_s": issued,
        "waited_s": waited,
        "pending": pending,
        "reused_early": reused_early,
        "right": bool((got == total).all()),
        "done_after": done_after,
        "future": bool((future.wait() == total).all().item()),
        "doubled": bool((doubled == 2 * total).all().item()),
        "source": work.source(),
    }


def test_stream_semantics_of_processgroupnccl():
    for r in run_ranks(2, stream_rank, timeout=300, comm_timeout=60):
        # The host is blocked neither by issuing nor by wait(): the GPU sleeps a second.
        assert r["issued_s"] < 0.5 and r["waited_s"] < 0.5, r
        assert r["pending"] and r["done_after"], r
        assert not r["reused_early"], r
        assert r["right"] and r["future"] and r["doubled"], r
        assert r["source"] == -1


def ddp_rank(store, rank, world):
    import ringcomm
    import ringcomm.hooks as hooks
    from ringcomm import staging

    torch.cuda.set_device(0)
    records = recording()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world
    )
    comm = ringcomm.Communicator(dist.PrefixStore("hooks", store), rank, world, timeout=60)
    tolerance = {"allreduce_hook": 1e-5, "fp16_compress_hook": 5e-3, "bf16_compress_hook": 3e-2}
    for hook_name, tol in tolerance.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 4),
        ).cuda()
        local = copy.deepcopy(model)  # the same steps without DDP: each rank's own gradient
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.1)
        ddp.register_comm_hook(comm, getattr(hooks, hook_name))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 32, generator=gen).cuda()
            local.load_state_dict(model.state_dict())
            local.zero_grad()
            local(x).square().mean().backward()
            expected = torch.cat([p.grad.reshape(-1) for p in local.parameters()]).cpu()
            comm.all_reduce(expected, op="avg")  # the rank average, on the host
            opt.zero_grad()
            ddp(x).square().mean().backward()
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
            assert torch.allclose(got, expected, rtol=tol, atol=tol), (
                hook_name,
                step,
                (got - expected).abs().max().item(),
            )
            opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        low, high = params.clone(), params.clone()
        comm.all_reduce(low, op="min")
        comm.all_reduce(high, op="max")
        assert torch.equal(low, high), hook_name  # every rank holds the same bits
    averager_rank(comm)
    assert staging.bytes_to_host() == 0, staging.bytes_to_host()
    assert comm.stats()["device"] == {"cuda:0": "cuda_ipc"}, comm.stats()["device"]
    assert not [line for line in records.lines if "stages CUDA tensors" in line], records.lines
    comm.close()
    dist.destroy_process_group()
    return True


def averager_rank(comm):
    from ringcomm import GradientAverager

    for compression in (None, "bf16"):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 16).cuda()
        averager = GradientAverager(model.parameters(), comm, compression=compression)
        model(torch.randn(8, 64, device="cuda") + comm.rank).sum().backward()
        averager.step()
        grad = model.weight.grad.cpu()
        low, high = grad.clone(), grad.clone()
        comm.all_reduce(low, op="min")
        comm.all_reduce(high, op="max")
        assert torch.equal(low, high), compression
        averager.remove()


def test_ddp_hooks_and_averager_train_on_the_device_path_without_staging():
    assert all(run_ranks(2, ddp_rank, make_comm=False, timeout=420))


def staged_rank(store, rank, world):
    import ringcomm
    from ringcomm import staging

    torch.cuda.set_device(0)
    records = recording()
    comm = ringcomm.Communicator(store, rank, world, timeout=60, device_transports=())
    for case in (1, 2):
        t = values(case, rank, 1000, torch.float32).cuda()
        comm.all_reduce(t)
        assert torch.equal(t.cpu(), exact(case, world, 1000, torch.float32, "sum"))
    staged = staging.bytes_to_host()
    device = comm.stats()["device"]
    comm.close()
    lines = [line for line in records.lines if "stages CUDA tensors on cuda:0" in line]
    return staged, device, lines


def test_without_device_transports_cuda_tensors_are_staged_and_logged_once():
    for staged, device, lines in run_ranks(2, staged_rank, make_comm=False, timeout=240):
        assert staged == 2 * 1000 * 4, staged
        assert device == {"cuda:0": "host"}, device
        assert len(lines) == 1 and "device_transports=() turns the device path off" in lines[0], (
            lines
        )


def sparse_rank(comm):
    import ringcomm
    from ringcomm import staging

    torch.cuda.set_device(0)
    rank, numel = comm.rank, 100_003
    results = []
    for case, (value_dtype, out_dtype, op) in enumerate(
        [
            (torch.float32, torch.float32, "sum"),
            (torch.bfloat16, torch.float32, "avg"),
            (torch.float16, torch.float16, "sum"),
        ]
    ):
        # Distinct indices per rank, a different count on each (rank 1 sends none in case 1).
        k = 0 if (case, rank) == (1, 1) else 1000 * (rank + 1) + case
        gen = torch.Generator().manual_seed(100 * case + rank)
        indices = torch.randperm(numel, generator=gen)[:k].to(torch.int32)
        values = torch.randint(-8, 9, (k,), generator=gen).to(value_dtype)
        out = torch.empty(numel, dtype=out_dtype, device="cuda")
        work = comm.sparse_all_reduce(
            indices.cuda(), values.cuda(), numel, out=out, op=op, async_op=True
        )
        work.wait()
        results.append((indices, values, out.cpu()))
    # Rank 1 sends an index past the end: every rank skips it and then says so.
    bad = torch.tensor([numel + 5 if rank == 1 else 0], dtype=torch.int32, device="cuda")
    comm.sparse_all_reduce(bad, torch.ones(1, device="cuda"), numel)
    try:
        comm._device_paths.get(torch.device("cuda", 0)).synchronize()
        refused = ""
    except ringcomm.ProtocolError as e:
        refused = str(e)
    return results, staging.bytes_to_host(), comm.stats()["device"], refused


def test_sparse_all_reduce_of_cuda_pairs_on_the_device_path():
    results = run_ranks(2, sparse_rank, timeout=240, comm_timeout=60)
    numel, world = 100_003, 2
    for case, op in enumerate(("sum", "avg", "sum")):
        expected = torch.zeros(numel, dtype=torch.float64)
        for r in range(world):
            indices, values, _ = results[r][0][case]
            expected.index_add_(0, indices.long(), values.double())
        if op == "avg":
            expected /= world
        for r in range(world):
            got = results[r][0][case][2]
            assert torch.equal(got, expected.to(got.dtype)), (case, r)
    for _, staged, device, refused in results:
        assert staged == 0 and device == {"cuda:0": "cuda_ipc"}, (staged, device)
        assert "index outside its output" in refused, refused


def topk_rank(comm, store):
    import ringcomm.hooks as hooks
    from ringcomm import staging

    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=comm.rank, world_size=comm.world_size
    )
    out = {}
    # "fixed": sparse exchanges from the second step; "signal": whole steps first, and the
    # ranks' energies summed on the device.
    for schedule in ("fixed", "signal"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4)
        ).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.1)
        state = hooks.TopKState(comm=comm, schedule=schedule, warmup_steps=0, adaptive=False)
        ddp.register_comm_hook(state, hooks.topk_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        before = staging.bytes_to_host()
        for step in range(6):
            gen = torch.Generator().manual_seed(100 * step + comm.rank)
            x = torch.randn(16, 32, generator=gen).cuda()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        low, high = params.clone(), params.clone()
        comm.all_reduce(low, op="min")
        comm.all_reduce(high, op="max")
        out[schedule] = (
            torch.equal(low, high),
            staging.bytes_to_host() - before,
            state.stats.compressed_buckets + state.stats.dense_buckets,
        )
    dist.destroy_process_group()
    return out


def test_ddp_with_topk_on_cuda_keeps_gradients_on_the_device():
    for out in run_ranks(2, topk_rank, with_store=True, timeout=300, comm_timeout=60):
        for schedule, (same, staged, buckets) in out.items():
            assert same and staged == 0 and buckets > 0, (schedule, same, staged, buckets)
