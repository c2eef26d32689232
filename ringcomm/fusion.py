"""Coalesced collectives on lists of tensors: argument checks and buffer lists for ringcomm._C.

The tensors are grouped by dtype, fused into buckets of at most `bucket_bytes` (one operation on
the wire each) and pipelined in the core (csrc/algorithms/coalesced.cc). Results land in the
given tensors and are bitwise those of one collective per tensor (docs/algorithms.md).
"""

from __future__ import annotations

import operator
from array import array

import torch

from . import _C, _extension
from ._buffers import FLOATING, TORCH_DTYPES, Buffer, has_memory, op_code

DEFAULT_BUCKET_BYTES = 25 << 20
FLOAT32 = TORCH_DTYPES[torch.float32]


class BufferList:
    """Addresses, element counts and dtype codes of a list of contiguous CPU tensors (or numpy
    arrays), for the core's list arguments: each a sequence of uint64 with the buffer protocol
    (format "Q"), which ringcomm._C reads in place."""

    __slots__ = ("ptrs", "counts", "dtypes")

    def __init__(self, items, name: str = "tensors"):
        if not isinstance(items, (list, tuple)):
            raise TypeError(
                f"{name} must be a list or tuple of tensors, got {type(items).__name__}"
            )
        # Lists of hundreds of small tensors are the point of coalescing, and torch's Python
        # accessors cost about 50 ns per tensor and attribute: for 1000 tensors, more than the
        # core's fused all-reduce takes beyond a flat one. So the common case (contiguous CPU
        # tensors of supported dtypes) is read in C++ by the torch backend's module where it is
        # built, else checked and read with map(), one pass per property, no pass spent on what
        # the others catch. Anything else (a numpy array, a sparse tensor, on which the unbound
        # Tensor methods raise, a failed check, an address of 0: an empty tensor's, or a
        # tensor's without memory) goes to the per-item path, which names the first bad item.
        module = torch_module()
        if module is not None:
            lists = module.tensor_lists(items)
            if lists is not None:
                self.ptrs, self.counts, self.dtypes = (memoryview(b).cast("Q") for b in lists)
                return
        else:
            try:
                codes = list(map(TORCH_DTYPES.get, map(_dtype, items)))
                if (
                    None not in codes
                    and all(map(_is_cpu, items))
                    and all(map(torch.Tensor.is_contiguous, items))
                    and not any(map(torch.Tensor.is_neg, items))
                ):
                    ptrs = list(map(torch.Tensor.data_ptr, items))
                    if 0 not in ptrs and all(map(has_memory, items)):
                        self.ptrs, self.dtypes = array("Q", ptrs), array("Q", codes)
                        self.counts = array("Q", map(torch.Tensor.numel, items))
                        return
            except (TypeError, RuntimeError, AttributeError):
                pass
        bufs = [Buffer(t, f"{name}[{i}]") for i, t in enumerate(items)]
        self.ptrs = array("Q", [b.ptr for b in bufs])
        self.counts = array("Q", [b.numel for b in bufs])
        self.dtypes = array("Q", [b.dtype for b in bufs])

    def __len__(self):
        return len(self.ptrs)


def torch_module():
    """ringcomm._C_torch where it is built already (_extension.built()), whose tensor_lists reads
    a list of tensors in C++, else None. The one place the readers of tensor lists (BufferList,
    cuda.pack and unpack, Communicator's blocking all_reduce) ask, so a test can swap it."""
    return _extension.built()


_dtype = operator.attrgetter("dtype")
_is_cpu = operator.attrgetter("is_cpu")


def check_bucket_bytes(bucket_bytes) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(f"bucket_bytes must be an int, got {type(bucket_bytes).__name__}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return bucket_bytes


def all_reduce_coalesced(comm, tensors, op, bucket_bytes, async_op):
    bufs = BufferList(tensors)
    code = op_code(op)
    if code == 1:
        for i, dt in enumerate(bufs.dtypes):
            if dt not in FLOATING:
                raise TypeError(
                    f"op avg needs floating dtypes, but tensors[{i}] is "
                    f"{getattr(tensors[i], 'dtype', None)}"
                )
    w = _C.all_reduce_coalesced(
        comm._core,
        bufs.ptrs,
        bufs.counts,
        bufs.dtypes,
        code,
        check_bucket_bytes(bucket_bytes),
        FLOAT32,
        1.0,
        async_op,
    )
    return comm._finish(w, tensors, async_op, keep=(tensors,))


def broadcast_coalesced(comm, tensors, src, bucket_bytes, async_op):
    bufs = BufferList(tensors)
    src = comm._check_rank(src, "src")
    w = _C.broadcast_coalesced(
        comm._core,
        bufs.ptrs,
        bufs.counts,
        bufs.dtypes,
        src,
        check_bucket_bytes(bucket_bytes),
        async_op,
    )
    return comm._finish(w, tensors, async_op, keep=(tensors,))


def all_gather_coalesced(comm, output_lists, input_tensors, bucket_bytes, async_op):
    inputs = BufferList(input_tensors, "input_tensors")
    if not isinstance(output_lists, (list, tuple)) or len(output_lists) != comm.world_size:
        raise ValueError(f"output_lists must be a list of world_size = {comm.world_size} lists")
    out_ptrs = []
    for r, outs in enumerate(output_lists):
        name = f"output_lists[{r}]"
        if isinstance(outs, (list, tuple)) and len(outs) != len(inputs):
            raise ValueError(
                f"{name} has {len(outs)} tensors, expected {len(inputs)} (one per input)"
            )
        bufs = BufferList(outs, name)
        for i in range(len(inputs)):
            if bufs.dtypes[i] != inputs.dtypes[i]:
                raise TypeError(
                    f"{name}[{i}] has dtype {outs[i].dtype}, "
                    f"input_tensors[{i}] has {input_tensors[i].dtype}"
                )
            if bufs.counts[i] != inputs.counts[i]:
                raise ValueError(
                    f"{name}[{i}] has {bufs.counts[i]} elements, "
                    f"input_tensors[{i}] has {inputs.counts[i]}"
                )
        out_ptrs.append(bufs.ptrs)
    w = _C.all_gather_coalesced(
        comm._core,
        out_ptrs,
        inputs.ptrs,
        inputs.counts,
        inputs.dtypes,
        check_bucket_bytes(bucket_bytes),
        async_op,
    )
    return comm._finish(w, output_lists, async_op, keep=(output_lists, input_tensors))
