"""How the reliability checks (faults.py, soak.py) lay out their local ranks and join them: each
rank's transport and fake host, and each rank's Communicator over a FileStore in the run's
temporary directory.

The checks' own processes never import ringcomm: only their ranks load the extension, so that a
check outlives a rank that crashes and reports the crash.
"""

from __future__ import annotations

import os
from datetime import timedelta

# RINGCOMM_TRANSPORT's values, and "mixed": auto over fake hosts of two ranks each, shared memory
# inside a host and TCP between hosts (as tests/ranks.py's TRANSPORTS).
TRANSPORTS = ("auto", "shm", "tcp", "mixed")


def rank_env(transport: str, rank: int, world: int, hosts: int = 0) -> dict:
    """What rank `rank` of `world` adds to its environment: its transport and, with `hosts`, its
    fake host (RINGCOMM_HOST_ID: the ranks in contiguous blocks over that many hosts)."""
    if transport == "mixed":
        transport, hosts = "auto", (world + 1) // 2
    env = {"RINGCOMM_TRANSPORT": transport}
    if hosts:
        env["RINGCOMM_HOST_ID"] = f"host{rank * hosts // world}"
    return env


def connect(path: str, rank: int, world: int, timeout_s: float, name: str):
    """In a rank, on one torch thread (the ranks share the cores): the ranks' store (a FileStore in
    the run's directory `path`) and this rank's Communicator over it."""
    import torch
    import torch.distributed as dist

    import ringcomm

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(path, "store"), world)
    comm = ringcomm.Communicator(
        store, rank, world, timeout=timedelta(seconds=timeout_s), name=name
    )
    return store, comm
