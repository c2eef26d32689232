"""ringcomm: collective communication for PyTorch over its own TCP transport.

    comm = ringcomm.init()                      # under torchrun, or init(store, rank, world_size)
    comm.all_reduce(tensor)                     # ring / tree / recursive doubling, picked by size
    work = comm.all_reduce(tensor, op="avg", async_op=True); work.wait()
"""
from ._C import RingcommError
from .communicator import Communicator, Work, init

__all__ = ["Communicator", "RingcommError", "Work", "init"]
__version__ = "0.1.0"
