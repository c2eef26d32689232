"""ringcomm.init(): env:// variables, an initialised torch.distributed, and torchrun."""

import os
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringcomm
from ranks import free_port, run_ranks, run_torchrun


def from_env(store, rank, world, port):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    comm = ringcomm.init(timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank)])
    comm.all_reduce(t)
    comm.close()
    return (comm.rank, comm.world_size, float(t))


def test_init_from_env_variables():
    results = run_ranks(3, from_env, free_port(), make_comm=False)
    assert results == [(r, 3, 3.0) for r in range(3)]


def from_process_group(store, rank, world):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    comm = ringcomm.init(timeout=timedelta(seconds=30))  # reuses the default group's store
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, op="max")
    g = torch.tensor([float(rank + 1)])
    dist.all_reduce(g)  # the process group keeps working beside it
    comm.close()
    dist.destroy_process_group()
    return float(t), float(g)


def test_init_reuses_torch_distributed_store():
    assert run_ranks(2, from_process_group, make_comm=False) == [(2.0, 3.0)] * 2


def test_init_without_rendezvous_information_is_a_clear_error(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        ringcomm.init()


# Also: importing ringcomm does not import dynamo, which takes 1.8 s of every rank's start.
SCRIPT = textwrap.dedent("""
    import sys, torch, ringcomm
    assert "torch._dynamo" not in sys.modules, "import ringcomm imported torch._dynamo"
    comm = ringcomm.init()
    t = torch.full((1000,), float(comm.rank))
    comm.all_reduce(t, op="avg")
    print(f"rank {comm.rank} of {comm.world_size}: {t[0].item()}", flush=True)
    comm.close()
""")


def test_torchrun_launch(tmp_path):
    stdout = run_torchrun(tmp_path, SCRIPT, 3)
    for r in range(3):
        assert f"rank {r} of 3: 1.0" in stdout
