"""Top-k gradient compression kernels (exact, deterministic), on contiguous tensors: CPU ones
here, CUDA ones through ringcomm.cuda (same selection, same output).

    values, indices = ringcomm.compress.topk(t, k)
    values, indices = ringcomm.compress.topk_with_residual(grad, residual, k)

Selection is by magnitude; values keep their sign. Ties go to the lower index, NaN ranks above
inf (as in torch.topk). Indices are int32 in ascending order (not sorted by value).
"""
from __future__ import annotations

import torch

from . import _C
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
        from . import cuda
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
        from . import cuda
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
