"""Turning tensors and numpy arrays into (address, element count, dtype code) for ringcomm._C."""

from __future__ import annotations

import numpy as np
import torch

from . import _C

# The core's codes by name (csrc/common/dtype.h, signature.h), under torch's and numpy's types.
TORCH_DTYPES = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}
NUMPY_DTYPES = {
    np.dtype(name): code for name, code in _C.DTYPE_CODES.items() if name != "bfloat16"
}  # numpy has none
FLOATING = set(_C.FLOATING_DTYPE_CODES.values())

# The core's codes follow torch.distributed.ReduceOp's values (SUM=0, AVG=1, PRODUCT=2, ...);
# torch's names for two of them are accepted too.
OP_CODES = {**_C.OP_CODES, "mean": _C.OP_CODES["avg"], "product": _C.OP_CODES["prod"]}
ALGORITHMS = dict(_C.ALGORITHM_CODES)
SPARSE_ALGORITHMS = dict(_C.SPARSE_ALGORITHM_CODES)


def has_memory(t: torch.Tensor) -> bool:
    """Whether the tensor's storage holds its elements: not one freed or shrunk under it (FSDP
    resizes storages to nothing), whose address still looks valid at a non-zero offset."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


class Buffer:
    """A contiguous CPU buffer: address, element count and dtype code of a tensor or array."""

    __slots__ = ("obj", "ptr", "numel", "dtype")

    def __init__(self, obj, name: str = "tensor"):
        if isinstance(obj, torch.Tensor):
            # Cheapest checks first: this runs on every call, and small all-reduces take ~1 us.
            # (is_cpu, not device.type: building the device object costs 300 ns.)
            if not obj.is_cpu:
                raise ValueError(
                    f"{name} must be a CPU tensor, got device {obj.device} "
                    "(Communicator.all_reduce and sparse_all_reduce take CUDA "
                    "tensors)"
                )
            if obj.layout is not torch.strided:
                raise ValueError(f"{name} must be a dense (strided) tensor, got {obj.layout}")
            code = TORCH_DTYPES.get(obj.dtype)
            if code is None:
                raise TypeError(
                    f"{name} has unsupported dtype {obj.dtype}; supported: "
                    + ", ".join(str(d) for d in TORCH_DTYPES)
                )
            if not obj.is_contiguous():
                raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
            if obj.is_neg():  # its memory holds the values' negatives
                raise ValueError(f"{name} is a negated view (call .resolve_neg() first)")
            self.ptr, self.numel, self.dtype = obj.data_ptr(), obj.numel(), code
            if self.numel and (self.ptr == 0 or not has_memory(obj)):
                raise ValueError(
                    f"{name} has no memory for its {self.numel} elements (a "
                    "ZeroTensor, or a storage freed under it)"
                )
        elif isinstance(obj, np.ndarray):
            if obj.dtype not in NUMPY_DTYPES:
                raise TypeError(f"{name} has unsupported dtype {obj.dtype}")
            if not obj.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous")
            if not obj.flags.writeable:
                raise ValueError(f"{name} must be writeable")
            self.ptr, self.numel, self.dtype = obj.ctypes.data, obj.size, NUMPY_DTYPES[obj.dtype]
        else:
            raise TypeError(
                f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__name__}"
            )
        self.obj = obj


def op_code(op) -> int:
    """ReduceOp from a string ("sum", "avg", ...), a torch.distributed.ReduceOp or its value."""
    code = OP_CODES.get(op) if isinstance(op, str) else None
    if code is not None:  # the common case, first: this runs on every call
        return code
    if isinstance(op, str):
        code = OP_CODES.get(op.lower())
        if code is None:
            raise ValueError(
                f"unsupported reduce op {op!r}; expected one of sum, avg, prod, min, "
                "max, band, bor, bxor"
            )
        return code
    red_op = getattr(op, "op", op)  # a ReduceOp object wraps a RedOpType in .op
    name = getattr(red_op, "name", None)
    if name is not None:
        code = OP_CODES.get(name.lower())
        if code is None:
            raise ValueError(
                f"unsupported reduce op {name}; expected SUM, AVG, PRODUCT, MIN, MAX, "
                "BAND, BOR or BXOR"
            )
        return code
    if isinstance(op, int) and op in OP_CODES.values():
        return op
    raise ValueError(f"unsupported reduce op {op!r}")


def algorithm_code(algorithm: str, known=ALGORITHMS) -> int:
    code = known.get(algorithm)
    if code is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(known)}")
    return code
