"""Turning tensors and numpy arrays into (address, element count, dtype code) for ringcomm._C."""
from __future__ import annotations

import numpy as np
import torch

# Codes match csrc/common/dtype.h.
TORCH_DTYPES = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
    torch.int8: 4, torch.uint8: 5, torch.int32: 6, torch.int64: 7, torch.bool: 8,
}
NUMPY_DTYPES = {
    np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
    np.dtype(np.int8): 4, np.dtype(np.uint8): 5, np.dtype(np.int32): 6, np.dtype(np.int64): 7,
    np.dtype(np.bool_): 8,
}
FLOATING = {0, 1, 2, 3}

# Values follow torch.distributed.ReduceOp: SUM=0, AVG=1, PRODUCT=2, MIN=3, MAX=4, BAND=5, BOR=6,
# BXOR=7.
OP_CODES = {"sum": 0, "avg": 1, "mean": 1, "prod": 2, "product": 2, "min": 3, "max": 4,
            "band": 5, "bor": 6, "bxor": 7}
ALGORITHMS = {"auto": 0, "ring": 1, "tree": 2, "recursive_doubling": 3, "halving_doubling": 12,
              "shared_buffer": 13, "hierarchical": 10}
# sparse_all_reduce: "ring" is the dense fallback (scatter locally, then ring all-reduce).
SPARSE_ALGORITHMS = {"auto": 0, "ring": 1, "sparse_gather": 8, "sparse_ranges": 9}


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
                raise ValueError(f"{name} must be a CPU tensor, got device {obj.device} "
                                 "(ringcomm stages CUDA tensors for all_reduce and "
                                 "sparse_all_reduce; ringcomm.nccl runs all_reduce over NCCL)")
            if obj.layout is not torch.strided:
                raise ValueError(f"{name} must be a dense (strided) tensor, got {obj.layout}")
            code = TORCH_DTYPES.get(obj.dtype)
            if code is None:
                raise TypeError(f"{name} has unsupported dtype {obj.dtype}; supported: "
                                + ", ".join(str(d) for d in TORCH_DTYPES))
            if not obj.is_contiguous():
                raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
            if obj.is_neg():  # its memory holds the values' negatives
                raise ValueError(f"{name} is a negated view (call .resolve_neg() first)")
            self.ptr, self.numel, self.dtype = obj.data_ptr(), obj.numel(), code
            if self.numel and (self.ptr == 0 or not has_memory(obj)):
                raise ValueError(f"{name} has no memory for its {self.numel} elements (a "
                                 "ZeroTensor, or a storage freed under it)")
        elif isinstance(obj, np.ndarray):
            if obj.dtype not in NUMPY_DTYPES:
                raise TypeError(f"{name} has unsupported dtype {obj.dtype}")
            if not obj.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous")
            if not obj.flags.writeable:
                raise ValueError(f"{name} must be writeable")
            self.ptr, self.numel, self.dtype = obj.ctypes.data, obj.size, NUMPY_DTYPES[obj.dtype]
        else:
            raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")
        self.obj = obj


def op_code(op) -> int:
    """ReduceOp from a string ("sum", "avg", ...), a torch.distributed.ReduceOp or its value."""
    code = OP_CODES.get(op) if isinstance(op, str) else None
    if code is not None:  # the common case, first: this runs on every call
        return code
    if isinstance(op, str):
        code = OP_CODES.get(op.lower())
        if code is None:
            raise ValueError(f"unsupported reduce op {op!r}; expected one of sum, avg, prod, min, "
                             "max, band, bor, bxor")
        return code
    red_op = getattr(op, "op", op)  # a ReduceOp object wraps a RedOpType in .op
    name = getattr(red_op, "name", None)
    if name is not None:
        code = OP_CODES.get(name.lower())
        if code is None:
            raise ValueError(f"unsupported reduce op {name}; expected SUM, AVG, PRODUCT, MIN, MAX, "
                             "BAND, BOR or BXOR")
        return code
    if isinstance(op, int) and op in OP_CODES.values():
        return op
    raise ValueError(f"unsupported reduce op {op!r}")


def algorithm_code(algorithm: str, known=ALGORITHMS) -> int:
    code = known.get(algorithm)
    if code is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(known)}")
    return code
