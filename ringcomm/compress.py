"""Gradient compression: the interface every compression implements (Compressor, over a Bucket
of gradients), which GradientAverager and the DDP hooks drive, and the top-k kernels (exact,
deterministic, on contiguous tensors: CPU ones here, CUDA ones through ringcomm.cuda, same
selection, same output).

    values, indices = ringcomm.compress.topk(t, k)
    values, indices = ringcomm.compress.topk_with_residual(grad, residual, k)

Selection is by magnitude; values keep their sign. Ties go to the lower index, NaN ranks above
inf (as in torch.topk). Indices are int32 in ascending order (not sorted by value).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _C, cuda
from ._buffers import TORCH_DTYPES

TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(t: torch.Tensor, name: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in TOPK_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; top-k supports float32, float16, bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _outputs(t: torch.Tensor, k: int):
    k = int(k)
    if not 0 <= k <= t.numel():
        raise ValueError(f"k = {k} out of range [0, {t.numel()}]")
    return k, torch.empty(k, dtype=t.dtype), torch.empty(k, dtype=torch.int32)


def topk(t: torch.Tensor, k: int):
    """The k elements of `t` (flattened) with the largest magnitude: (values, int32 indices)."""
    if isinstance(t, torch.Tensor) and t.is_cuda:
        return cuda.topk(t, k)
    _check(t, "tensor")
    k, values, indices = _outputs(t, k)
    _C.topk_kernel(TORCH_DTYPES[t.dtype], t.data_ptr(), t.numel(), k, indices.data_ptr(),
                   values.data_ptr())
    return values, indices


def topk_with_residual(grad: torch.Tensor, residual: torch.Tensor, k: int, value_dtype=None):
    """Error-feedback step: acc = grad + residual; return the top-k of acc as (values, indices),
    the values as `value_dtype` (float32, float16 or bfloat16; default grad's dtype, rounded to
    nearest even), and leave acc in `residual` (updated in place) with each selected entry
    replaced by what rounding its value to value_dtype lost (zero when nothing was)."""
    if isinstance(grad, torch.Tensor) and grad.is_cuda:
        return cuda.topk_with_residual(grad, residual, k, value_dtype)
    _check(grad, "grad")
    _check(residual, "residual")
    if residual.dtype != grad.dtype or residual.numel() != grad.numel():
        raise ValueError(f"residual ({residual.dtype}, {residual.numel()} elements) must match "
                         f"grad ({grad.dtype}, {grad.numel()} elements)")
    value_dtype = grad.dtype if value_dtype is None else value_dtype
    if value_dtype not in TOPK_DTYPES:
        raise TypeError(f"value_dtype must be one of {TOPK_DTYPES}, got {value_dtype}")
    k, _, indices = _outputs(grad, k)
    values = torch.empty(k, dtype=value_dtype)
    _C.topk_with_residual_kernel(TORCH_DTYPES[grad.dtype], grad.data_ptr(), residual.data_ptr(),
                                 grad.numel(), k, indices.data_ptr(), values.data_ptr(),
                                 TORCH_DTYPES[value_dtype])
    return values, indices


@dataclass
class Bucket:
    """Gradients averaged as one: `grads`, shaped like their parameters; `flat`, one tensor they
    are views of (DDP's bucket), or None; `slot`, which memory the compressor keeps for them;
    `layout`, their parameters as ((id, numel), ...), for memory that follows its parameters
    when DDP rebuilds its buckets; `index`, DDP's bucket index, under which Communicator.stats()
    counts the bucket's operations; `is_last`, whether the step ends with this bucket."""

    grads: list
    slot: int
    flat: Optional[torch.Tensor] = None
    layout: Optional[tuple] = None
    index: Optional[int] = None
    is_last: bool = False


class Compressor:
    """A gradient compression, split as GRACE splits one (Xu et al., 2021): compress() turns a
    bucket into what goes on the wire, exchange() starts the collectives that combine it over the
    ranks, decompress() turns what they return into the average. A compressor with error feedback
    keeps per bucket slot what compression lost, adds it in compress() and keeps the new loss
    there or in decompress(). GradientAverager and the DDP hooks call average(); the compressors
    are ringcomm.hooks.TopKState and ringcomm.hooks.PowerSGDState, which also hold their settings,
    memory and statistics."""

    def compress(self, comm, bucket: Bucket):
        """On the caller's thread: what exchange() sends and decompress() needs."""
        raise NotImplementedError

    def exchange(self, comm, bucket: Bucket, compressed) -> torch.futures.Future:
        """Starts the bucket's collectives on `comm`: a Future completed with what decompress()
        takes, or failed with the error."""
        raise NotImplementedError

    def decompress(self, comm, bucket: Bucket, compressed, exchanged) -> Optional[torch.Tensor]:
        """The bucket's average: a tensor shaped like bucket.flat (one dimension where the
        bucket has no flat), or None where it is written into bucket.grads."""
        raise NotImplementedError

    def end_step(self, comm) -> None:
        """Called once every bucket of a step is averaged."""

    def check_device(self, device: torch.device) -> None:
        """Raises ValueError for gradients on a device this compressor cannot average."""

    def average(self, comm, bucket: Bucket) -> torch.futures.Future:
        """Starts averaging the bucket: a Future completed with decompress()'s result once it is
        ready (and the step ended, if the bucket is its last), or holding the error, as it was
        raised (a then() callback would hold it wrapped in a RuntimeError)."""
        compressed = self.compress(comm, bucket)
        done = torch.futures.Future()

        def finish(fut: torch.futures.Future) -> None:
            try:
                average = self.decompress(comm, bucket, compressed, fut.value())
                if bucket.is_last:
                    self.end_step(comm)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the future
                done.set_exception(as_exception(e))
                return
            done.set_result(average)

        self.exchange(comm, bucket, compressed).add_done_callback(finish)
        return done


def as_exception(error: BaseException) -> Exception:
    """What a Future can hold (a KeyboardInterrupt, say, is no Exception)."""
    if isinstance(error, Exception):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
