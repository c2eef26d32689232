"""ringcomm: collective communication for PyTorch over its own TCP transport.

    comm = ringcomm.init()                      # under torchrun, or init(store, rank, world_size)
    comm.all_reduce(tensor)                     # ring / tree / recursive doubling, picked by size
    work = comm.all_reduce(tensor, op="avg", async_op=True); work.wait()
    comm.all_reduce_coalesced(tensors)          # many tensors as a few fused, pipelined operations
    averager = ringcomm.GradientAverager(model.parameters(), comm)   # then averager.step()
"""
from ._C import RingcommError
from .communicator import Communicator, Work, init, shm_bytes_sent
from .averager import GradientAverager
from .backend import communicator_of, register_backend
from . import hooks

register_backend()  # dist.init_process_group("ringcomm") works from here on

__all__ = ["Communicator", "GradientAverager", "RingcommError", "Work", "communicator_of", "hooks",
           "init", "register_backend", "shm_bytes_sent"]
__version__ = "0.1.0"
