"""The DDP comm hook of any ringcomm.compress.Compressor: a compression written as compress /
exchange / decompress runs under DDP (eager or compiled) with this hook, as it runs under
GradientAverager.

    ddp.register_comm_hook(MyCompressor(), ringcomm.hooks.compressor_hook)

The bucket's memory slot is DDP's bucket index (under compiled DDP, one per parameter); its
operations and whether it went whole are counted in Communicator.stats()["buckets"], and the step
ends with DDP's last bucket.

This module must not use `from __future__ import annotations` (see default.py: DDP compares the
hook's annotations as objects).
"""

import time

import torch
import torch.distributed as dist

from ..compress import Bucket, Compressor
from .state import communicator_for, completed, ringcomm_named


def run_compressor(state: Compressor, bucket) -> torch.futures.Future:
    """What compressor_hook and the named hooks built on it do, once `state` is known to be the
    right kind."""
    comm = communicator_for(state.comm)
    if isinstance(bucket, tuple):  # compiled DDP discards the future: finish in place now
        grad, param = bucket
        state.check_device(grad.device)
        slot = state.slot_of_param(param, comm)
        average = state.average(comm, Bucket([grad], slot, flat=grad)).wait()
        if average is not None and average.data_ptr() != grad.data_ptr():
            grad.copy_(average.view_as(grad))
        return completed(grad)
    called = time.monotonic_ns()
    buffer = bucket.buffer()
    state.check_device(buffer.device)
    layout = tuple((id(p), p.numel()) for p in bucket.parameters())
    average = state.average(
        comm,
        Bucket(
            bucket.gradients(),
            bucket.index(),
            flat=buffer,
            layout=layout,
            index=bucket.index(),
            is_last=bucket.is_last(),
        ),
    )
    return comm.bucket_stats.watch(bucket.index(), called, average)


@ringcomm_named
def compressor_hook(
    state: Compressor, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: averages the bucket with `state`, a ringcomm.compress.Compressor."""
    if not isinstance(state, Compressor):
        raise TypeError(
            f"compressor_hook needs a ringcomm.compress.Compressor, got {type(state).__name__}"
        )
    return run_compressor(state, bucket)
