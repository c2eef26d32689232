"""CUDA tensors through ringcomm's host transports (ringcomm/staging.py and the torch backend's
staging in csrc/torch/backend.cc): real ranks, several of which may share one GPU, against sums
computed on the host; and the clients: DDP with ringcomm's hooks and with the backend,
GradientAverager."""

import torch
import torch.distributed as dist

from ranks import run_ranks


def values(rank, n, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7 * rank + n)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def expected(world, n, dtype=torch.float32):
    return sum(values(r, n, dtype).double() for r in range(world)).to(dtype)


def all_reduce_rank(comm, sizes):
    rank, world = comm.rank, comm.world_size
    for n in sizes:
        for async_op in (False, True):
            t = values(rank, n).cuda()
            # Work on the current stream before the call must be waited for: the input is only
            # final once this kernel has run.
            t.mul_(2).div_(2)
            work = comm.all_reduce(t, op="sum", async_op=async_op)
            if async_op:
                work.wait()
            assert torch.equal(t.cpu(), expected(world, n)), (n, async_op)
            if async_op:
                assert torch.equal(work.get_future().wait().cpu(), expected(world, n))
    return True


def test_all_reduce_of_cuda_tensors_in_slices():
    # 4 KiB slices: 0, one partial, exactly one, several and a ragged tail.
    sizes = [0, 5, 1024, 1024 * 7 + 3, 300_000]
    assert all(
        run_ranks(
            2, all_reduce_rank, sizes, timeout=240, env={"RINGCOMM_STAGING_SLICE_BYTES": "4096"}
        )
    )


def sparse_rank(comm):
    rank, world = comm.rank, comm.world_size
    indices = torch.tensor([rank, 10 + rank, 99], dtype=torch.int32, device="cuda")
    vals = torch.tensor([1.0, 2.0, 3.0], device="cuda")
    out = comm.sparse_all_reduce(indices, vals, 100)
    assert out.is_cuda
    want = torch.zeros(100)
    for r in range(world):
        want[r] += 1.0
        want[10 + r] += 2.0
        want[99] += 3.0
    assert torch.equal(out.cpu(), want)
    return True


def test_sparse_all_reduce_of_cuda_pairs():
    assert all(run_ranks(2, sparse_rank, timeout=240))


def ddp_rank(store, rank, world, hook_name):
    import ringcomm
    import ringcomm.hooks as hooks

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    comm = ringcomm.Communicator(dist.PrefixStore("hooks", store), rank, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    ).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    state = hooks.TopKState(comm=comm, ratio=0.25) if hook_name == "topk_hook" else comm
    ddp.register_comm_hook(state, getattr(hooks, hook_name))
    torch.manual_seed(1 + comm.rank)
    x = torch.randn(16, 32, device="cuda")
    ddp(x).square().sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]).cpu()
    mean = grads.clone()
    comm.all_reduce(mean, op="avg")  # every rank must hold the same averaged gradient
    comm.close()
    dist.destroy_process_group()
    return torch.equal(grads, mean)


def test_ddp_hooks_take_cuda_gradients():
    for hook in ("allreduce_hook", "bf16_compress_hook", "topk_hook"):
        assert all(run_ranks(2, ddp_rank, hook, make_comm=False, timeout=300)), hook


def backend_rank(store, rank, world):
    import ringcomm  # noqa: F401  (registers the backend)

    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    t = values(rank, 1000).cuda()
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), expected(world, 1000))
    b = torch.full((10,), float(rank), device="cuda")
    dist.broadcast(b, 1)
    assert torch.equal(b.cpu(), torch.full((10,), 1.0))
    out = [torch.empty(3, device="cuda") for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank), device="cuda"))
    assert [o.cpu().tolist() for o in out] == [[float(r)] * 3 for r in range(world)]
    work = dist.all_reduce(t, async_op=True)
    work.wait()  # the current stream waits for the copy back
    assert torch.equal(t.cpu(), expected(world, 1000) * world)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    ddp(torch.randn(4, 8, device="cuda") + rank).sum().backward()
    grad = model.weight.grad.clone()
    dist.all_reduce(grad)
    assert torch.allclose(grad.cpu() / world, model.weight.grad.cpu())
    dist.destroy_process_group()
    return True


def test_backend_serves_cuda_tensors():
    assert all(run_ranks(2, backend_rank, make_comm=False, timeout=300))


def averager_rank(comm, compression):
    from ringcomm import GradientAverager

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).cuda()
    averager = GradientAverager(model.parameters(), comm, compression=compression)
    model(torch.randn(8, 16, device="cuda") + comm.rank).sum().backward()
    averager.step()
    grad = model.weight.grad.cpu()
    mean = grad.clone()
    comm.all_reduce(mean, op="avg")
    return torch.allclose(grad, mean)


def test_gradient_averager_on_cuda():
    for compression in (None, "bf16"):
        assert all(run_ranks(2, averager_rank, compression, timeout=240)), compression
