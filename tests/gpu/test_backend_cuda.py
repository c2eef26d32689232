"""The torch.distributed backend "ringcomm" with CUDA tensors, 2 ranks on one GPU: all_reduce and
its coalesced form on the device path against exact results, no byte staged to the host; the
stream semantics of ProcessGroupNCCL through dist.all_reduce; broadcast, reduce, gather, scatter,
the all-gathers, the reduce-scatters, the all-to-alls of any splits and send/recv (both ways at
once through batch_isend_irecv) on the device path too, nothing staged; recv from any source
refused there with a clear error;
DDP on CUDA over the backend alone and with ringcomm's hooks given the group, no byte on the host
from its construction on; FSDP2 on CUDA, on the device path, against FSDP2 on the CPU."""

import copy
import logging
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ranks import run_ranks

SIZES = [0, 1, 999, (1 << 20) + 3]
SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second at the H100's and H200's clocks


def values(case, rank, n, dtype):
    """Small integers: every sum of a few of them, halved or not, is exact in every dtype."""
    gen = torch.Generator().manual_seed(1009 * case + rank)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def exact(case, world, n, dtype, op):
    stacked = torch.stack([values(case, r, n, dtype).double() for r in range(world)])
    reduced = {
        "sum": stacked.sum(0),
        "avg": stacked.sum(0) / world,
        "max": stacked.max(0).values,
        "premul": (stacked * 0.5).sum(0),
    }[op]
    return reduced.to(dtype)


def reduce_op(op):
    if op == "premul":
        return dist._make_nccl_premul_sum(0.5)
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[op]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def init(store, rank, world):
    torch.cuda.set_device(0)
    records = Records()
    log = logging.getLogger("ringcomm")
    log.setLevel(logging.INFO)
    log.addHandler(records)
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    return records


def staged_lines(records):
    return [line for line in records.lines if "stages" in line]


def all_reduce_rank(store, rank, world):
    from ringcomm import staging

    records = init(store, rank, world)
    case = 0
    floats = (torch.float32, torch.float16, torch.bfloat16)
    cases = [(dtype, op) for dtype in floats for op in ("sum", "avg", "max", "premul")]
    cases += [(torch.int64, "sum"), (torch.int32, "max")]
    for dtype, op in cases:
        for n in SIZES:
            for async_op in (False, True):
                case += 1
                t = values(case, rank, n, dtype).cuda()
                work = dist.all_reduce(t, op=reduce_op(op), async_op=async_op)
                if async_op:
                    work.wait()
                got = t.cpu()  # a copy on the current stream, after the wait
                assert torch.equal(got, exact(case, world, n, dtype, op)), (dtype, op, n, async_op)
    tensors = [values(1000 + i, rank, n, torch.float32).cuda() for i, n in enumerate(SIZES)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced is deprecated
        dist.all_reduce_coalesced(tensors)
    for i, n in enumerate(SIZES):
        assert torch.equal(tensors[i].cpu(), exact(1000 + i, world, n, torch.float32, "sum"))
    staged = staging.bytes_to_host()
    lines = staged_lines(records)
    dist.destroy_process_group()
    return staged, lines


def test_all_reduce_of_cuda_tensors_runs_on_the_device_path():
    for staged, lines in run_ranks(2, all_reduce_rank, make_comm=False, timeout=300):
        assert staged == 0 and not lines, (staged, lines)


def stream_rank(store, rank, world):
    init(store, rank, world)
    n = 1 << 20
    warm = torch.ones(8, device="cuda")
    dist.all_reduce(warm)  # joins the device path: a collective, out of the timings below
    torch.cuda.synchronize()
    t = torch.full((n,), float(rank + 1), device="cuda")
    dropped = torch.ones(n, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy for about a second...
    t.fill_(10.0 * (rank + 1))  # ...then writes the input the all-reduce must read
    start = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    issued = time.monotonic() - start
    pending = not work.is_completed()
    ptr = dropped.data_ptr()
    dist.all_reduce(dropped, async_op=True)
    del dropped  # and its Work: the operation still holds the memory, which a new tensor of
    other = torch.zeros(n, device="cuda")  # the size on the current stream must not take yet
    reused_early = other.data_ptr() == ptr
    work.wait()
    waited = time.monotonic() - start
    total = 10.0 * world * (world + 1) / 2
    got = t.cpu()  # on the current stream, after the wait: blocks until the GPU is done
    done_after = work.is_completed()
    future = work.get_future()
    doubled = future.then(lambda fut: fut.value()[0] * 2).wait()
    result = {
        "issued_s": issued,
        "waited_s": waited,
        "pending": pending,
        "reused_early": reused_early,
        "right": bool((got == total).all()),
        "done_after": done_after,
        "future": bool((future.wait()[0] == total).all().item()),
        "doubled": bool((doubled == 2 * total).all().item()),
    }
    dist.destroy_process_group()
    return result


def test_dist_all_reduce_has_the_stream_semantics_of_processgroupnccl():
    for r in run_ranks(2, stream_rank, make_comm=False, timeout=300):
        # The host is blocked neither by issuing nor by wait(): the GPU sleeps a second.
        assert r["issued_s"] < 0.5 and r["waited_s"] < 0.5, r
        assert r["pending"] and r["done_after"], r
        assert not r["reused_early"], r
        assert r["right"] and r["future"] and r["doubled"], r


def collectives_rank(store, rank, world):
    from ringcomm import staging

    records = init(store, rank, world)
    n, right = 1001, []
    # On the device path: broadcast, the all-gathers and the reduce-scatters.
    t = torch.full((n,), float(rank + 1), device="cuda")
    t[0] = -0.0 if rank == 1 else 5.0  # a broadcast's bits arrive as sent
    dist.broadcast(t, src=1)
    right.append(bool((t[1:] == 2.0).all()) and str(t[0].item()) == "-0.0")
    gathered = torch.empty(world * n, device="cuda")
    dist.all_gather_into_tensor(gathered, torch.full((n,), float(rank), device="cuda"))
    right.append(torch.equal(gathered.cpu(), torch.arange(world).repeat_interleave(n).float()))
    parts = [torch.empty(n, dtype=torch.int64, device="cuda") for _ in range(world)]
    dist.all_gather(parts, torch.full((n,), rank, dtype=torch.int64, device="cuda"))
    right.append(all(bool((p == q).all()) for q, p in enumerate(parts)))
    out = torch.empty(n, device="cuda")
    source = torch.arange(world * n, dtype=torch.float32, device="cuda")
    dist.reduce_scatter_tensor(out, source, op=dist.ReduceOp.AVG)
    right.append(torch.equal(out.cpu(), torch.arange(rank * n, (rank + 1) * n).float()))
    right.append(torch.equal(source.cpu(), torch.arange(world * n).float()))  # left alone
    dist.reduce_scatter_tensor(out, torch.ones(world * n, device="cuda"), op=premul())
    right.append(bool((out == 0.5 * world).all()))
    # reduce (the others' tensors left alone), gather, scatter, all_to_all_single (equal splits).
    r = torch.full((n,), float(rank + 1), device="cuda")
    dist.reduce(r, dst=0)
    right.append(bool((r == (world * (world + 1) / 2 if rank == 0 else rank + 1)).all()))
    into = [torch.empty(n, device="cuda") for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((n,), float(rank), device="cuda"), into, dst=1)
    right.append(rank != 1 or all(bool((g == q).all()) for q, g in enumerate(into)))
    part = torch.empty(n, device="cuda")
    pieces = [torch.full((n,), 10.0 + q, device="cuda") for q in range(world)]
    dist.scatter(part, pieces if rank == 0 else None, src=0)
    right.append(bool((part == 10.0 + rank).all()))
    received = torch.empty(world * 4, device="cuda")
    sent = torch.arange(world * 4, dtype=torch.float32, device="cuda") + 100 * rank
    dist.all_to_all_single(received, sent)
    want = torch.cat([torch.arange(rank * 4, rank * 4 + 4) + 100 * q for q in range(world)])
    right.append(torch.equal(received.cpu(), want.float()))
    # all_to_all_single of uneven splits, the list forms of all_to_all and reduce_scatter.
    splits = [1, 3] if rank == 0 else [3, 1]
    got = torch.empty(4, device="cuda")
    dist.all_to_all_single(got, torch.full((4,), float(rank), device="cuda"), splits, splits)
    right.append(torch.equal(got.cpu(), torch.tensor([0.0] * splits[0] + [1.0] * splits[1])))
    outs = [torch.empty(q + 1, device="cuda") for q in range(world)]
    dist.all_to_all(
        outs, [torch.full((rank + 1,), 10.0 * rank + q, device="cuda") for q in range(world)]
    )
    right.append(all(bool((o == 10.0 * q + rank).all()) for q, o in enumerate(outs)))
    out = torch.empty(n, device="cuda")
    dist.reduce_scatter(
        out, [torch.full((n,), float(q + rank), device="cuda") for q in range(world)]
    )
    right.append(bool((out == world * rank + world * (world - 1) / 2).all()))
    # send/recv, and both ways at once through batch_isend_irecv, of more than the messages in
    # flight (a send waits for its receive): on streams of their own for sends and receives.
    if rank == 0:
        dist.send(torch.full((n,), 7.0, device="cuda"), dst=1)
    else:
        got = torch.empty(n, device="cuda")
        dist.recv(got, src=0)
        right.append(bool((got == 7.0).all()))
    big, peer = 3 << 20, 1 - rank
    mine = torch.full((big,), float(rank), device="cuda")
    theirs = torch.empty(big, device="cuda")
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    right.append(bool((theirs == float(peer)).all()))
    on_device = staging.bytes_to_host()
    # A receive from any source raises: sends run on the device path, matched by source.
    if rank == 1:
        try:
            dist.recv(torch.empty(n, device="cuda"))
            right.append(False)
        except ValueError as e:
            right.append("src=" in str(e))
    lines = staged_lines(records)
    dist.destroy_process_group()
    return right, on_device, lines


def premul():
    return dist._make_nccl_premul_sum(0.5)


def test_collectives_and_send_recv_on_cuda_tensors_run_on_the_device_path():
    for right, on_device, lines in run_ranks(2, collectives_rank, make_comm=False, timeout=240):
        assert all(right), right
        assert on_device == 0, on_device
        assert not lines, lines


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)
    )


def ddp_rank(store, rank, world):
    import ringcomm.hooks as hooks
    from ringcomm import staging

    init(store, rank, world)
    tolerance = {None: 1e-5, "allreduce_hook": 1e-5, "bf16_compress_hook": 3e-2}
    staged = {}
    for hook_name, tol in tolerance.items():
        model = mlp().cuda()
        local = copy.deepcopy(model)  # the same steps without DDP: each rank's own gradient
        before = staging.bytes_to_host()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.1)
        if hook_name is not None:
            ddp.register_comm_hook(dist.group.WORLD, getattr(hooks, hook_name))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 32, generator=gen).cuda()
            local.load_state_dict(model.state_dict())
            local.zero_grad()
            local(x).square().mean().backward()
            expected = torch.cat([p.grad.reshape(-1) for p in local.parameters()]).cpu()
            dist.all_reduce(expected, op=dist.ReduceOp.AVG)  # the rank average, on the host
            opt.zero_grad()
            ddp(x).square().mean().backward()
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            staged[hook_name] = staging.bytes_to_host() - before
            got = got.cpu()
            assert torch.allclose(got, expected, rtol=tol, atol=tol), (
                hook_name,
                step,
                (got - expected).abs().max().item(),
            )
            opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        low, high = params.clone(), params.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        assert torch.equal(low, high), hook_name  # every rank holds the same bits
    dist.destroy_process_group()
    return staged


def test_ddp_on_cuda_over_the_backend_keeps_gradients_on_the_device():
    for staged in run_ranks(2, ddp_rank, make_comm=False, timeout=300):
        assert set(staged.values()) == {0}, staged


def fsdp_rank(store, rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ringcomm import staging

    init(store, rank, world)
    mesh = init_device_mesh(device, (world,))
    model = mlp().to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=gen).to(device), torch.randint(0, 4, (16,)).to(device)
    losses = []
    for _ in range(6):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(float(summed) / world)
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    staged = staging.bytes_to_host()
    dist.destroy_process_group()
    return losses, full, staged


def test_fsdp2_on_cuda_runs_on_the_device_path_and_matches_fsdp2_on_cpu():
    cuda = run_ranks(2, fsdp_rank, "cuda", make_comm=False, timeout=300)
    cpu = run_ranks(2, fsdp_rank, "cpu", make_comm=False, timeout=300)
    for (losses, state, staged), (cpu_losses, cpu_state, _) in zip(cuda, cpu):
        assert staged == 0, staged
        assert losses[-1] < losses[0], losses  # it trains
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-4
        )
        for k in state:
            torch.testing.assert_close(state[k], cpu_state[k], rtol=1e-4, atol=1e-4)
            assert torch.equal(state[k], cuda[0][1][k]), k
