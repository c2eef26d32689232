"""DDP communication hooks over ringcomm, for DDP on any backend (gloo, ringcomm, ...).

    from ringcomm.hooks import allreduce_hook, fp16_compress_hook
    ddp.register_comm_hook(None, allreduce_hook)      # None: a ringcomm communicator over the
                                                      # default group, made on first use
    ddp.register_comm_hook(comm, fp16_compress_hook)  # or a ringcomm.Communicator / ringcomm group
    ddp.register_comm_hook(PowerSGDState(), powersgd_hook)  # low-rank, with error feedback
"""
from .default import (allreduce_hook, bf16_compress_hook, bf16_compress_wrapper, fp16_compress_hook,
                      fp16_compress_wrapper)
from .powersgd import PowerSGDState, PowerSGDStats, powersgd_hook
from .state import communicator_for, default_communicator
from .topk import TopKState, TopKStats, topk_hook

__all__ = ["PowerSGDState", "PowerSGDStats", "powersgd_hook", "TopKState", "TopKStats", "topk_hook",
           "allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "communicator_for",
           "default_communicator", "fp16_compress_hook", "fp16_compress_wrapper"]
