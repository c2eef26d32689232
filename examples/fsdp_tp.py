"""FSDP2 and tensor parallelism on the "ringcomm" backend, CPU:

    torchrun --nproc-per-node 4 examples/fsdp_tp.py

A 2 x 2 DeviceMesh: tensor parallelism (ColwiseParallel / RowwiseParallel) inside each pair of
ranks, FSDP2 (fully_shard) across the pairs. --backend gloo to compare.
"""

import argparse

parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
parser.add_argument(
    "--backend", default="ringcomm", help="torch.distributed backend (default: %(default)s)"
)
parser.add_argument("--steps", type=int, default=20, help="training steps (default: %(default)s)")
args = parser.parse_args()

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ringcomm  # registers the backend

if ringcomm.launch.discover().world_size != 4:
    parser.error(
        "run it on 4 ranks: torchrun --nproc-per-node 4 examples/fsdp_tp.py "
        "(or srun -n 4, mpirun -n 4)"
    )
ringcomm.launch.init_process_group(args.backend)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
for step in range(args.steps):
    x, y = torch.randn(32, 64, generator=data), torch.randint(0, 10, (32,), generator=data)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 0 and dist.get_rank() == 0:
        print(f"step {step:2d} loss {loss.item():.4f}")
dist.destroy_process_group()
