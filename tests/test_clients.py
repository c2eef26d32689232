"""torch.distributed's own clients on the "ringcomm" backend, in real processes: DDP, DeviceMesh,
FSDP2, DTensor tensor parallelism, functional collectives (eager and compiled), subgroups, and
Lightning (tests/test_lightning.py). Each runs the same computation on gloo in the same process
and compares. DDP, FSDP2 and DTensor run under TORCH_DISTRIBUTED_DEBUG=DETAIL too, where torch
wraps each backend to check every collective's fingerprint (with ringcomm's sequence number)
across the ranks before it runs."""

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


def init(backend, store, rank, world, debug="OFF", name=None):
    """The default group, its groups made under TORCH_DISTRIBUTED_DEBUG=`debug` (torch reads the
    level when it makes a group). `name` (default: the backend's) keeps its keys in the store
    apart from an earlier group's."""
    dist.set_debug_level(getattr(dist.DebugLevel, debug))
    dist.init_process_group(
        backend, store=dist.PrefixStore(name or backend, store), rank=rank, world_size=world
    )
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert (type(backend).__name__ == "_ProcessGroupWrapper") == (debug == "DETAIL"), debug


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


# ---- DDP -------------------------------------------------------------------------------------

DDP_STEPS = 3


def ddp_training(store, rank, world, debug, hook=None):
    """DDP_STEPS steps of DDP on ringcomm, `hook` (a ringcomm hook, the group as its state)
    averaging the gradients if given; the final weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init("ringcomm", store, rank, world, debug, name=f"ringcomm-{hook and hook.__name__}")
    model = DDP(mlp(), bucket_cap_mb=0.001)  # a few buckets
    if hook is not None:
        model.register_comm_hook(dist.group.WORLD, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return weights


def ddp_both(store, rank, world, debug):
    from ringcomm.hooks import allreduce_hook

    return (
        ddp_training(store, rank, world, debug),
        ddp_training(store, rank, world, debug, hook=allreduce_hook),
    )


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_ddp_matches_one_process(debug):
    """DDP's own all-reduce through the backend, and ringcomm's hook on the same group, against
    one process averaging every rank's gradients."""
    world = 2
    results = run_ranks(world, ddp_both, debug, make_comm=False, timeout=120)
    reference = mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        opt.zero_grad()
        for rank in range(world):
            x, y = batch(rank, step)
            (nn.functional.cross_entropy(reference(x), y) / world).backward()
        opt.step()
    for rank, (own, hooked) in enumerate(results):
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(own[k], v, **TOLERANCE)
            torch.testing.assert_close(hooked[k], v, **TOLERANCE)
            assert torch.equal(own[k], results[0][0][k]), f"rank {rank}: {k} differs"


# ---- DETAIL: a mismatch reported once -----------------------------------------------------


def error_of(call):
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return None


def mismatched(store, rank, world):
    """Under DETAIL, ranks that issue different collectives: first ones torch's fingerprints tell
    apart, then ones only ringcomm's signatures do (op=sum against op=max)."""
    init("ringcomm", store, rank, world, "DETAIL")
    t = torch.ones(4)
    fingerprint = error_of(lambda: dist.all_reduce(t) if rank == 0 else dist.broadcast(t, 0))
    dist.all_reduce(t)  # torch stopped that one before ringcomm saw it: the group goes on
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
    signature = error_of(lambda: dist.all_reduce(t, op=op))
    return fingerprint, signature, float(t[0])


def test_detail_mode_reports_a_mismatch_once_on_every_rank():
    results = run_ranks(2, mismatched, make_comm=False, timeout=60)
    for fingerprint, signature, value in results:
        assert fingerprint.startswith("Detected mismatch between collectives on ranks"), fingerprint
        assert "OpType=ALLREDUCE" in fingerprint and "OpType=BROADCAST" in fingerprint, fingerprint
        assert "mismatched operations" not in fingerprint, fingerprint
        assert value == 2.0  # the all_reduce that followed
        assert "mismatched operations: rank" in signature, signature
        assert "op=sum" in signature and "op=max" in signature, signature
        assert "Detected mismatch" not in signature, signature


# ---- FSDP2 ---------------------------------------------------------------------------------


def fsdp_training(backend, store, rank, world, debug="OFF"):
    from torch.distributed.fsdp import fully_shard

    init(backend, store, rank, world, debug)
    mesh = init_device_mesh("cpu", (world,))
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    x, y = batch(rank, 0)  # the same batch each step: the loss must fall
    for _ in range(6):
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


def fsdp_both(store, rank, world, debug):
    return (
        fsdp_training("ringcomm", store, rank, world, debug),
        fsdp_training("gloo", store, rank, world),
    )


@pytest.mark.parametrize("world,debug", [(2, "OFF"), (4, "OFF"), (2, "DETAIL")])
def test_fsdp2_matches_gloo(world, debug):
    results = run_ranks(world, fsdp_both, debug, make_comm=False, timeout=180)
    for rank, ((losses, state), (gloo_losses, gloo_state)) in enumerate(results):
        assert losses[-1] < losses[0], losses  # it trains
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(gloo_losses), **TOLERANCE)
        assert state.keys() == gloo_state.keys()
        for k in state:
            torch.testing.assert_close(state[k], gloo_state[k], **TOLERANCE)
            assert torch.equal(state[k], results[0][0][1][k]), f"rank {rank}: {k} differs"


# ---- DTensor: tensor parallelism on a 2 x 2 mesh ---------------------------------------------


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def tensor_parallel(store, rank, world, debug):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    init("ringcomm", store, rank, world, debug)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = parallelize_module(
        TwoLayers(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
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


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_tensor_parallel_on_a_2d_mesh_matches_one_process(debug):
    results = run_ranks(4, tensor_parallel, debug, make_comm=False, timeout=120)
    reference = TwoLayers()
    outs = [reference(batch(dp, 0)[0]) for dp in range(2)]
    ((outs[0].sum() + outs[1].sum()) / 2).backward()
    for dp_rank, out, grads, names in results:
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
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: "), out.stderr[-2000:]


def test_fsdp_tp_example_trains_on_ringcomm_as_on_gloo(tmp_path):
    script = (EXAMPLES / "fsdp_tp.py").read_text()
    losses = {}
    for backend in ("ringcomm", "gloo"):
        out = run_torchrun(
            tmp_path, script, 4, timeout=180, args=["--backend", backend, "--steps", "6"]
        )
        losses[backend] = [float(x) for x in re.findall(r"step +\d+ loss ([\d.]+)", out)]
    assert len(losses["ringcomm"]) == 2, losses  # steps 0 and 5
    assert losses["ringcomm"] == pytest.approx(losses["gloo"], rel=1e-4), losses
