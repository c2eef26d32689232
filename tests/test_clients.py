"""torch.distributed's own clients on the "ringcomm" backend, in real processes: DeviceMesh,
FSDP2, DTensor tensor parallelism, functional collectives (eager and compiled), subgroups, and
Lightning (tests/test_lightning.py). Each runs the same computation on gloo in the same process
and compares."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from ranks import run_ranks, run_torchrun

# Summation orders differ between backends (ring vs gloo's): results agree to rounding.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def init(backend, store, rank, world):
    dist.init_process_group(backend, store=dist.PrefixStore(backend, store), rank=rank,
                            world_size=world)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


# ---- FSDP2 ---------------------------------------------------------------------------------

def fsdp_training(backend, store, rank, world):
    from torch.distributed.fsdp import fully_shard

    init(backend, store, rank, world)
    mesh = init_device_mesh("cpu", (world,))
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    x, y = batch(rank, 0)  # the same batch each step: the loss must fall
    for step in range(6):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(float(summed) / world)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return losses, full


def fsdp_both(store, rank, world):
    return fsdp_training("ringcomm", store, rank, world), fsdp_training("gloo", store, rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_matches_gloo(world):
    results = run_ranks(world, fsdp_both, make_comm=False, timeout=180)
    for rank, ((losses, state), (gloo_losses, gloo_state)) in enumerate(results):
        assert losses[-1] < losses[0], losses  # it trains
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(gloo_losses), **TOLERANCE)
        assert state.keys() == gloo_state.keys()
        for k in state:
            torch.testing.assert_close(state[k], gloo_state[k], **TOLERANCE)
            assert torch.equal(state[k], results[0][0][1][k]), f"rank {rank}: {k} differs from rank 0"


# ---- DTensor: tensor parallelism on a 2 x 2 mesh ---------------------------------------------

class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def tensor_parallel(store, rank, world):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    init("ringcomm", store, rank, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = parallelize_module(TwoLayers(), mesh["tp"], {"up": ColwiseParallel(),
                                                         "down": RowwiseParallel()})
    x = batch(dp_rank, 0)[0]
    out = model(x)
    out.sum().backward()
    # data parallel over "dp": average the tensor-parallel shards' gradients
    grads = {}
    for name, p in model.named_parameters():
        local = p.grad.to_local()
        dist.all_reduce(local, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        grads[name] = p.grad.full_tensor()
    names = sorted(dist.distributed_c10d._world.pg_names.values())
    dist.destroy_process_group()
    return dp_rank, out.detach(), grads, names


def test_tensor_parallel_on_a_2d_mesh_matches_one_process():
    results = run_ranks(4, tensor_parallel, make_comm=False, timeout=120)
    reference = TwoLayers()
    outs = [reference(batch(dp, 0)[0]) for dp in range(2)]
    ((outs[0].sum() + outs[1].sum()) / 2).backward()
    for rank, (dp_rank, out, grads, names) in enumerate(results):
        torch.testing.assert_close(out, outs[dp_rank].detach(), **TOLERANCE)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOLERANCE)
        assert len(names) >= 3, names  # the default group and one per mesh dimension


# ---- functional collectives, eager and compiled ------------------------------------------

def functional(store, rank, world):
    import torch.distributed._functional_collectives as funcol

    init("ringcomm", store, rank, world)
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()

    def collectives(x):
        total = funcol.all_reduce(x, "sum", group)
        gathered = funcol.all_gather_tensor(x, 0, group)
        scattered = funcol.reduce_scatter_tensor(gathered * 2, "sum", 0, group)
        return total + 1, gathered, scattered

    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    eager = [funcol.wait_tensor(t) if hasattr(t, "wait") else t for t in collectives(x)]
    compiled = torch.compile(collectives, fullgraph=True)(x)  # inductor: C++ codegen on CPU
    # looked up by name, as compiled graphs do
    same_group = dist.distributed_c10d._resolve_process_group(group.group_name) is group
    dist.destroy_process_group()
    return [t.clone() for t in eager], [t.clone() for t in compiled], same_group


def test_functional_collectives_eager_and_compiled():
    world = 2
    results = run_ranks(world, functional, make_comm=False, timeout=120)
    xs = [torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world)]
    gathered = torch.cat(xs)
    for rank, (eager, compiled, same_group) in enumerate(results):
        expect = [sum(xs) + 1, gathered, (gathered * 2 * world).chunk(world)[rank]]
        for got in (eager, compiled):
            for g, e in zip(got, expect):
                torch.testing.assert_close(g, e)
        assert same_group


# ---- subgroups ------------------------------------------------------------------------------

def subgroups(store, rank, world):
    init("ringcomm", store, rank, world)
    mine, _ = dist.new_subgroups(group_size=2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    # torch 2.13's split_group needs a default group bound to an accelerator (gloo cannot on CPU
    # either); new_group is the CPU way to the same groups
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    split = groups[rank % 2]
    s = torch.tensor([float(rank)])
    dist.all_reduce(s, group=split)
    backend = dist.get_backend(mine), dist.get_backend(split)
    dist.destroy_process_group()
    return float(t), float(s), backend


def test_new_subgroups_and_groups_of_every_other_rank():
    results = run_ranks(4, subgroups, make_comm=False, timeout=60)
    assert [r[:2] for r in results] == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]
    assert all(r[2] == ("ringcomm", "ringcomm") for r in results)


EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("example", ["fsdp_tp.py", "lightning_digits.py", "train_ddp.py"])
def test_examples_answer_help(example):
    out = subprocess.run([sys.executable, str(EXAMPLES / example), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: "), out.stderr[-2000:]


def test_fsdp_tp_example_trains_on_ringcomm_as_on_gloo(tmp_path):
    script = (EXAMPLES / "fsdp_tp.py").read_text()
    losses = {}
    for backend in ("ringcomm", "gloo"):
        out = run_torchrun(tmp_path, script, 4, timeout=180, args=["--backend", backend,
                                                                   "--steps", "6"])
        losses[backend] = [float(x) for x in re.findall(r"step +\d+ loss ([\d.]+)", out)]
    assert len(losses["ringcomm"]) == 2, losses  # steps 0 and 5
    assert losses["ringcomm"] == pytest.approx(losses["gloo"], rel=1e-4), losses
