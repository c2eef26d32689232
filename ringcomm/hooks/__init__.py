"""DDP communication hooks over ringcomm, for DDP on any backend (gloo, ringcomm, ...).

    from ringcomm.hooks import allreduce_hook, fp16_compress_hook
    ddp.register_comm_hook(None, allreduce_hook)      # None: a ringcomm communicator over the
                                                      # default group, made on first use
    ddp.register_comm_hook(comm, fp16_compress_hook)  # or a ringcomm.Communicator / ringcomm group
    ddp.register_comm_hook(PowerSGDState(), powersgd_hook)  # low-rank, with error feedback
    ddp.register_comm_hook(TopKState(), topk_hook)          # top-k, with error feedback
    ddp.register_comm_hook(QuantizeState(), quantize_hook)  # 8-bit, with error feedback
    ddp.register_comm_hook(MyCompressor(), compressor_hook) # any ringcomm.compress.Compressor

Under torch.compile (compiled DDP: compiled autograd and optimize_ddp="python_reducer"), register
`torch.compiler.disable(hook)`: dynamo cannot put ringcomm's collectives in a graph, and traced
into the hook only to give up frame after frame (6 steps of a 2-rank powersgd DDP: 20.5 s, 8.2 s
with the hook disabled; tests/test_powersgd.py). The hooks are not disabled here: that imports
dynamo with ringcomm, 1.8 s more at every process's start.
"""

from .compressor import compressor_hook
from .default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .powersgd import PowerSGDState, PowerSGDStats, powersgd_hook
from .quantize import QuantizeState, quantize_hook
from .state import communicator_for, default_communicator
from .topk import TopKState, TopKStats, topk_hook

__all__ = [
    "PowerSGDState",
    "PowerSGDStats",
    "powersgd_hook",
    "QuantizeState",
    "quantize_hook",
    "TopKState",
    "TopKStats",
    "topk_hook",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "communicator_for",
    "compressor_hook",
    "default_communicator",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]
