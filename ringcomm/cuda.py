"""ringcomm's CUDA kernels (the ringcomm._C_cuda extension) on torch CUDA tensors.

    import ringcomm.cuda as rc_cuda
    ok, reason = rc_cuda.status()            # can they run here, and if not, why
    rc_cuda.reduce_(out, a, b, "sum")        # out = a + b, every op and dtype of all_reduce
    values, indices = rc_cuda.topk(t, k)     # exact, ties to the lower index, indices ascending
    values, indices = rc_cuda.topk_with_residual(grad, residual, k)
    rc_cuda.scatter_add_(out, indices, values)
    flat = rc_cuda.pack(tensors, dtype=torch.bfloat16, scale=1 / world)
    rc_cuda.unpack(flat, tensors, divide=world)

Every call enqueues its kernels on the current CUDA stream of the tensors' device and returns
without synchronising the host, as torch's own operations do. The kernels are the same arithmetic
as the CPU ones (csrc/kernels/*_math.h): a GPU rank and a CPU rank reduce and select alike.

This module imports ringcomm._C_cuda only on first use, so `import ringcomm` never loads a CUDA
library; without the extension (no nvcc at install) or without a GPU, `status()` says why and
every kernel raises RuntimeError with that reason.
"""

from __future__ import annotations

import functools
from array import array
from typing import Optional, Sequence

import torch

from . import fusion
from ._buffers import TORCH_DTYPES, op_code

TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Scaling kinds of csrc/kernels/pack_math.h.
_SCALE_NONE, _SCALE_MULTIPLY, _SCALE_DIVIDE = 0, 1, 2


@functools.lru_cache(maxsize=None)
def _load():
    """(module, None) or (None, why the kernels cannot run in this process)."""
    try:
        from . import _C_cuda
    except ImportError as e:
        return None, (
            f"ringcomm was built without its CUDA extension ({e}); reinstall with nvcc "
            "on PATH or RINGCOMM_CUDA=1"
        )
    count, reason = _C_cuda.device_count()
    if count == 0:
        return None, f"no CUDA device visible to ringcomm._C_cuda ({reason})"
    if not torch.cuda.is_available():
        return None, (
            f"torch {torch.__version__} has no CUDA (a CPU build, or it sees no device): "
            "the kernels take torch CUDA tensors"
        )
    return _C_cuda, None


def status() -> tuple[bool, str]:
    """(True, "") when the kernels can run here, else (False, the reason)."""
    module, reason = _load()
    return module is not None, reason or ""


def built() -> bool:
    """Whether ringcomm._C_cuda was built (it may still have no device to run on)."""
    try:
        from . import _C_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels():
    module, reason = _load()
    if module is None:
        raise RuntimeError(f"ringcomm's CUDA kernels cannot run: {reason}")
    return module


def _check(t: torch.Tensor, name: str, dtypes=None, device: Optional[torch.device] = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    allowed = dtypes if dtypes is not None else TORCH_DTYPES
    if t.dtype not in allowed:
        raise TypeError(
            f"{name} has dtype {t.dtype}; supported: " + ", ".join(str(d) for d in allowed)
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def reduce_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op="sum") -> torch.Tensor:
    """out = op(a, b) element-wise (out may be a or b); avg reduces as sum. Returns out."""
    kernels = _kernels()
    _check(out, "out")
    for name, t in (("a", a), ("b", b)):
        _check(t, name, device=out.device)
        if t.dtype != out.dtype or t.numel() != out.numel():
            raise ValueError(
                f"{name} ({t.dtype}, {t.numel()} elements) must match out "
                f"({out.dtype}, {out.numel()} elements)"
            )
    with torch.cuda.device(out.device):
        kernels.reduce(
            TORCH_DTYPES[out.dtype],
            op_code(op),
            out.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            out.numel(),
            _stream(out.device),
        )
    return out


def divide_(x: torch.Tensor, divisor: int) -> torch.Tensor:
    """x /= divisor in place: all_reduce's avg (truncating on integers, as NCCL's ncclAvg)."""
    kernels = _kernels()
    _check(x, "x")
    with torch.cuda.device(x.device):
        kernels.divide(
            TORCH_DTYPES[x.dtype], x.data_ptr(), x.numel(), int(divisor), _stream(x.device)
        )
    return x


def _topk_outputs(t: torch.Tensor, k: int):
    k = int(k)
    if not 0 <= k <= t.numel():
        raise ValueError(f"k = {k} out of range [0, {t.numel()}]")
    values = torch.empty(k, dtype=t.dtype, device=t.device)
    indices = torch.empty(k, dtype=torch.int32, device=t.device)
    return k, values, indices


def _workspace(kernels, t: torch.Tensor) -> torch.Tensor:
    # From torch's caching allocator, used on the current stream only: freed when it returns.
    return torch.empty(kernels.topk_workspace_bytes(t.numel()), dtype=torch.uint8, device=t.device)


def topk(t: torch.Tensor, k: int):
    """The k elements of `t` (flattened) with the largest magnitude: (values, int32 indices),
    indices ascending, ties to the lower index, NaN above inf (the CPU kernel's selection)."""
    kernels = _kernels()
    _check(t, "tensor", TOPK_DTYPES)
    k, values, indices = _topk_outputs(t, k)
    with torch.cuda.device(t.device):
        workspace = _workspace(kernels, t)
        kernels.topk(
            TORCH_DTYPES[t.dtype],
            t.data_ptr(),
            t.numel(),
            k,
            indices.data_ptr(),
            values.data_ptr(),
            workspace.data_ptr(),
            workspace.numel(),
            _stream(t.device),
        )
    return values, indices


def topk_with_residual(
    grad: torch.Tensor, residual: torch.Tensor, k: int, value_dtype: Optional[torch.dtype] = None
):
    """Error feedback: residual += grad; return its top-k as (values, indices), the values as
    `value_dtype` (default grad's dtype), and leave in those entries of `residual` (in place) what
    rounding to value_dtype lost, as ringcomm.compress.topk_with_residual does on the CPU."""
    kernels = _kernels()
    _check(grad, "grad", TOPK_DTYPES)
    _check(residual, "residual", TOPK_DTYPES, device=grad.device)
    if value_dtype is not None and value_dtype not in TOPK_DTYPES:
        raise TypeError(f"value_dtype must be one of {TOPK_DTYPES}, got {value_dtype}")
    if residual.dtype != grad.dtype or residual.numel() != grad.numel():
        raise ValueError(
            f"residual ({residual.dtype}, {residual.numel()} elements) must match "
            f"grad ({grad.dtype}, {grad.numel()} elements)"
        )
    k, values, indices = _topk_outputs(grad, k)
    with torch.cuda.device(grad.device):
        workspace = _workspace(kernels, grad)
        kernels.topk_with_residual(
            TORCH_DTYPES[grad.dtype],
            grad.data_ptr(),
            residual.data_ptr(),
            grad.numel(),
            k,
            indices.data_ptr(),
            values.data_ptr(),
            workspace.data_ptr(),
            workspace.numel(),
            _stream(grad.device),
        )
    if value_dtype is None or value_dtype == grad.dtype:
        return values, indices
    wire = values.to(value_dtype)
    # The selected entries were zeroed; distinct indices, so the order of adds does not matter.
    residual.index_add_(0, indices.long(), values - wire.to(values.dtype))
    return wire, indices


def scatter_add_(
    out: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    check: bool = True,
    bad: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out.view(-1)[indices] += values, for distinct int32 indices (one rank's top-k), in an order
    that does not depend on scheduling. Indices outside out are skipped; with `check` (one host
    synchronisation) they raise ValueError afterwards; without it, a nonzero is left in `bad`
    (an int32 tensor on out's device) where given."""
    kernels = _kernels()
    _check(out, "out", TOPK_DTYPES)
    _check(values, "values", (out.dtype,), device=out.device)
    _check(indices, "indices", (torch.int32,), device=out.device)
    if indices.numel() != values.numel():
        raise ValueError(f"{indices.numel()} indices for {values.numel()} values")
    with torch.cuda.device(out.device):
        if check or bad is None:
            bad = torch.zeros(1, dtype=torch.int32, device=out.device)
        else:
            _check(bad, "bad", (torch.int32,), device=out.device)
        kernels.scatter_add(
            TORCH_DTYPES[out.dtype],
            out.data_ptr(),
            out.numel(),
            indices.data_ptr(),
            values.data_ptr(),
            values.numel(),
            bad.data_ptr(),
            _stream(out.device),
        )
        if check and bool(bad.item()):
            raise ValueError(f"an index outside [0, {out.numel()}) was given to scatter_add_")
    return out


def _scaling(scale: Optional[float], divide: Optional[float]):
    if scale is not None and divide is not None:
        raise ValueError("give scale or divide, not both")
    if scale is not None:
        return _SCALE_MULTIPLY, float(scale)
    if divide is not None:
        return _SCALE_DIVIDE, float(divide)
    return _SCALE_NONE, 1.0


def _list(tensors: Sequence[torch.Tensor], device: torch.device):
    """(addresses, element counts) as uint64 buffers, and the dtype code, of a list of contiguous
    CUDA tensors of one dtype on `device`. A list of a thousand gradients is what packing is for,
    and torch's Python accessors cost about 0.6 us per tensor: read in C++ by the torch module
    where it is built, else (or when that read meets anything unusual) checked item by item here,
    which names the first bad one."""
    if not tensors:
        raise ValueError("no tensors given")
    module = fusion.torch_module()
    if module is not None:
        lists = module.tensor_lists(tensors, str(device))
        if lists is not None:
            ptrs, counts, codes = (memoryview(b).cast("Q") for b in lists)
            if lists[2] == lists[2][:8] * len(tensors):  # one dtype: every code is the first's
                return ptrs, counts, codes[0]
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        _check(t, f"tensors[{i}]", (dtype,), device=device)
    return (
        array("Q", [t.data_ptr() for t in tensors]),
        array("Q", [t.numel() for t in tensors]),
        TORCH_DTYPES[dtype],
    )


def pack(
    tensors: Sequence[torch.Tensor],
    dtype: Optional[torch.dtype] = None,
    scale: Optional[float] = None,
    divide: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The tensors (one dtype, one device) back to back in one flat buffer of `dtype` (default
    theirs; casts are float32 <-> float16 / bfloat16), each element multiplied by `scale` or
    divided by `divide` on the way, rounded once."""
    kernels = _kernels()
    device = tensors[0].device if tensors else None
    ptrs, counts, code = _list(tensors, device)
    dtype = dtype or tensors[0].dtype
    total = sum(counts)
    if out is None:
        out = torch.empty(total, dtype=dtype, device=device)
    _check(out, "out", (dtype,), device=device)
    if out.numel() != total:
        raise ValueError(f"out has {out.numel()} elements for {total}")
    kind, factor = _scaling(scale, divide)
    with torch.cuda.device(device):
        kernels.pack(
            code,
            ptrs,
            counts,
            0,
            total,
            out.data_ptr(),
            TORCH_DTYPES[dtype],
            kind,
            factor,
            _stream(device),
        )
    return out


def unpack(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: Optional[float] = None,
    divide: Optional[float] = None,
) -> None:
    """pack()'s inverse: the flat buffer back into `tensors` (in place), cast to their dtype and
    scaled on the way."""
    kernels = _kernels()
    device = flat.device
    _check(flat, "flat", device=device)
    ptrs, counts, code = _list(tensors, device)
    if flat.numel() != sum(counts):
        raise ValueError(f"flat has {flat.numel()} elements for {sum(counts)}")
    kind, factor = _scaling(scale, divide)
    with torch.cuda.device(device):
        kernels.unpack(
            flat.data_ptr(),
            TORCH_DTYPES[flat.dtype],
            code,
            ptrs,
            counts,
            0,
            flat.numel(),
            kind,
            factor,
            _stream(device),
        )
