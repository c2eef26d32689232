"""ringcomm: collective communication for PyTorch over its own TCP and shared-memory transports.

comm = ringcomm.init()                      # under torchrun, srun or mpirun; or init(store, rank, n)
comm.all_reduce(tensor)                     # ring / tree / recursive doubling, picked by size
work = comm.all_reduce(tensor, op="avg", async_op=True); work.wait()
comm.all_reduce_coalesced(tensors)          # many tensors as a few fused, pipelined operations
averager = ringcomm.GradientAverager(model.parameters(), comm)   # then averager.step()
"""

import atexit
import logging

from . import _C
from ._env import env_flag
from ._C import (
    AbortedError,
    CollectiveTimeoutError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RingcommError,
)
from .communicator import Communicator, Work, init, shm_bytes_read, shm_bytes_sent
from .averager import GradientAverager
from .backend import communicator_of, register_backend
from . import algorithms, hooks, launch, trace

register_backend()  # dist.init_process_group("ringcomm") works from here on

# What the core reports under RINGCOMM_DEBUG goes to the "ringcomm" logger at INFO. Without any
# handler configured, Python would drop it: then it is printed to stderr as before.
logger = logging.getLogger("ringcomm")
if env_flag("RINGCOMM_DEBUG"):
    if not logger.hasHandlers():
        _stderr = logging.StreamHandler()
        _stderr.setFormatter(logging.Formatter("[ringcomm] %(message)s"))
        logger.addHandler(_stderr)
        logger.setLevel(logging.INFO)
    _C.set_log_sink(logger.info)
    # Threads of the core may log until they are joined at exit; Python's logging is gone after.
    atexit.register(_C.set_log_sink, None)

__all__ = [
    "AbortedError",
    "CollectiveTimeoutError",
    "Communicator",
    "GradientAverager",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "RingcommError",
    "Work",
    "algorithms",
    "communicator_of",
    "hooks",
    "init",
    "launch",
    "register_backend",
    "shm_bytes_read",
    "shm_bytes_sent",
    "trace",
]
__version__ = "0.1.0"
