"""powersgd_hook and PowerSGDState on CUDA gradients over the Communicator's device path: 2 ranks
on one GPU over CUDA IPC. Under DDP every rank holds the same parameters bit for bit after each
step; with factors of 2 columns each step's average is, to rounding, what the same hook makes of
the same gradients on the CPU, and with factors of full rank it is the dense average of the
ranks' gradients. GradientAverager takes the state on CUDA, and its step() returns while the GPU
is still busy with the work before it. ringcomm stages no byte through host memory."""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ranks import run_ranks
from test_device_routing import SLEEP_CYCLES, recording

STEPS = 6  # 2 dense (start_iter), then compressed, warm-started and with error feedback


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )


def batch(step, rank):
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).cpu()


def relative(got, want):
    return float((got - want).abs().max() / want.abs().max())


def same_on_every_rank(comm, t):
    low, high = t.clone(), t.clone()
    comm.all_reduce(low, op="min")
    comm.all_reduce(high, op="max")
    return torch.equal(low, high)


def ddp_with_powersgd(model, comm, rank_r, min_compression_rate=2.0):
    from ringcomm.hooks import PowerSGDState, powersgd_hook

    state = PowerSGDState(
        matrix_approximation_rank=rank_r,
        start_iter=2,
        min_compression_rate=min_compression_rate,
        comm=comm,
    )
    device_ids = [0] if next(model.parameters()).is_cuda else None
    ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=0.05)  # several buckets
    ddp.register_comm_hook(state, powersgd_hook)
    return ddp, state


def against_the_cpu(comm, rank):
    """Factors of 2 columns: the CUDA model and a CPU copy of it, reset to the CUDA one's
    parameters before each step, each with a state of its own: the averaged gradients agree to
    rounding."""
    model, cpu_model = make_model().cuda(), make_model()
    ddp, state = ddp_with_powersgd(model, comm, 2)
    cpu_ddp, cpu_state = ddp_with_powersgd(cpu_model, comm, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors, same = [], []
    for step in range(STEPS):
        x = batch(step, rank)
        cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        for net, inputs in ((ddp, x.cuda()), (cpu_ddp, x)):
            net.zero_grad()
            net(inputs).square().mean().backward()
        got = flat(p.grad for p in model.parameters())
        errors.append(relative(got, flat(p.grad for p in cpu_model.parameters())))
        opt.step()
        same.append(same_on_every_rank(comm, flat(model.parameters())))
    return errors, same, state.stats.compressed_tensors, cpu_state.stats.compressed_tensors


def at_full_rank(comm, rank):
    """Factors of full rank (128 columns, clipped to min(n, m)), every matrix compressed: each
    step's average is the dense average of the ranks' own gradients (P then spans every column
    of the averaged gradient)."""
    model = make_model().cuda()
    local = copy.deepcopy(model)  # the same steps without DDP: this rank's own gradient
    ddp, state = ddp_with_powersgd(model, comm, 128, min_compression_rate=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors, same = [], []
    for step in range(STEPS):
        x = batch(step, rank).cuda()
        local.load_state_dict(model.state_dict())
        local.zero_grad()
        local(x).square().mean().backward()
        expected = flat(p.grad for p in local.parameters())
        comm.all_reduce(expected, op="avg")  # on the host
        opt.zero_grad()
        ddp(x).square().mean().backward()
        errors.append(relative(flat(p.grad for p in model.parameters()), expected))
        opt.step()
        same.append(same_on_every_rank(comm, flat(model.parameters())))
    return errors, same, state.stats.compressed_tensors


def averager_behind_a_busy_stream(comm, rank):
    """GradientAverager with a full-rank PowerSGDState drawing a new starting Q every step: a
    warm-up step, then one whose backward and step() are issued behind a second of GPU sleep. The
    host is back long before the GPU is (nothing waits for the stream: not the starting Q's copy
    to the device, not the all-reduces, not step()); the gradients are then the dense average."""
    from ringcomm import GradientAverager
    from ringcomm.hooks import PowerSGDState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)).cuda()
    params = list(model.parameters())
    state = PowerSGDState(
        matrix_approximation_rank=64, start_iter=0, min_compression_rate=0, warm_start=False
    )
    averager = GradientAverager(params, comm, bucket_bytes=8_000, compression=state)
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(8, 64, generator=gen).cuda()
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        if step == 1:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy for about a second
        start = time.monotonic()
        loss = model(x).square().mean()
        own = torch.autograd.grad(loss, params, retain_graph=True)
        loss.backward()
        averager.step()
        issued_s = time.monotonic() - start
        torch.cuda.synchronize()
    expected = flat(own)
    comm.all_reduce(expected, op="avg")
    got = flat(p.grad for p in params)
    averager.remove()
    return issued_s, relative(got, expected), same_on_every_rank(comm, got), state.step


def powersgd_rank(store, rank, world):
    import ringcomm
    from ringcomm import staging

    torch.cuda.set_device(0)
    records = recording()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world
    )
    comm = ringcomm.Communicator(dist.PrefixStore("hooks", store), rank, world, timeout=60)
    out = {
        "cpu": against_the_cpu(comm, rank),
        "full": at_full_rank(comm, rank),
        "averager": averager_behind_a_busy_stream(comm, rank),
        "staged": staging.bytes_to_host(),
        "device": comm.stats()["device"],
        "staging_lines": [line for line in records.lines if "stages CUDA tensors" in line],
    }
    comm.close()
    dist.destroy_process_group()
    return out


def test_powersgd_on_cuda_gradients_over_the_device_path():
    for r in run_ranks(2, powersgd_rank, make_comm=False, timeout=300):
        errors, same, compressed, cpu_compressed = r["cpu"]
        assert all(same), same  # every rank applied the same update, bit for bit
        assert compressed == cpu_compressed == 3 * (STEPS - 2), (compressed, cpu_compressed)
        assert max(errors) < 1e-3, errors
        errors, same, compressed = r["full"]
        assert all(same), same
        assert compressed == 3 * (STEPS - 2), compressed
        assert max(errors) < 1e-4, errors
        issued_s, error, same, steps = r["averager"]
        assert issued_s < 0.5 and error < 1e-4 and same and steps == 2, r["averager"]
        assert r["staged"] == 0, r["staged"]
        assert r["device"] == {"cuda:0": "cuda_ipc"}, r["device"]
        assert not r["staging_lines"], r["staging_lines"]
