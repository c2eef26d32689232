"""DDP comm hooks that average gradients with ringcomm: dense, fp16- and bf16-compressed.

Same contract as torch.distributed.algorithms.ddp_comm_hooks.default_hooks. A hook gets
(state, bucket) and returns a Future holding one tensor of the bucket's shape and dtype, the
gradients averaged over ranks. `bucket` is a GradBucket (eager DDP), whose all-reduce is only
started, so it overlaps the rest of backward; or a (grad, param) tuple (compiled DDP's python
reducer), which discards the returned future, so the averaged gradient is written into `grad`
before the hook returns. `state` is None, a ringcomm.Communicator or a ringcomm process group (see
state.communicator_for). The all-reduce's algorithm follows the bucket's size, not the load at
start (compress.all_reduce_algorithm): the same bits on every run.

This module must not use `from __future__ import annotations`: DDP compares the `bucket` and
return annotations with dist.GradBucket and Future[Tensor] as objects, and refuses strings.
"""

import time

import torch
import torch.distributed as dist

from ..compress import average_densely
from .state import communicator_for, completed, ringcomm_named


@ringcomm_named
def allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket over ranks in place with one ringcomm all_reduce."""
    called = time.monotonic_ns()
    comm = communicator_for(state)
    grad = bucket[0] if isinstance(bucket, tuple) else bucket.buffer()
    if isinstance(bucket, tuple):
        average_densely(comm, grad, async_op=False)
        return completed(grad)
    work = average_densely(comm, grad)
    comm.bucket_stats.add_work(bucket.index(), work)
    return comm.bucket_stats.watch(bucket.index(), called, work.get_future())


def _compressed(dtype: torch.dtype, hook, state, bucket) -> torch.futures.Future:
    """Runs `hook` on a `dtype` copy of the bucket's gradients, then copies the result back into
    the bucket's own tensor (its dtype, in place) and returns that tensor."""
    if isinstance(bucket, tuple):
        grad, param = bucket
        result = hook(state, (grad.to(dtype), param)).wait()
        return completed(grad.copy_(result))
    buffer = bucket.buffer()
    bucket.set_buffer(buffer.to(dtype))
    return hook(state, bucket).then(lambda fut: buffer.copy_(fut.value()))


@ringcomm_named
def fp16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket over ranks as float16: half the bytes of allreduce_hook."""
    return _compressed(torch.float16, allreduce_hook, state, bucket)


@ringcomm_named
def bf16_compress_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket over ranks as bfloat16 (float32's range, fewer mantissa bits); works
    on CPU-only torch, unlike torch's hook of that name."""
    return _compressed(torch.bfloat16, allreduce_hook, state, bucket)


def fp16_compress_wrapper(hook):
    """A hook that runs `hook` on float16 gradients and casts its result back."""

    def fp16_compress_wrapper_hook(
        state, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        return _compressed(torch.float16, hook, state, bucket)

    return ringcomm_named(fp16_compress_wrapper_hook)


def bf16_compress_wrapper(hook):
    """A hook that runs `hook` on bfloat16 gradients and casts its result back."""

    def bf16_compress_wrapper_hook(
        state, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        return _compressed(torch.bfloat16, hook, state, bucket)

    return ringcomm_named(bf16_compress_wrapper_hook)
