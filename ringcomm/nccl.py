"""ringcomm over NCCL, for CUDA tensors (csrc/transport/nccl/): ringcomm's own all-reduce
schedules (ring, double binary tree, recursive doubling) with NCCL's point-to-point calls as the
wire and ringcomm's CUDA kernels combining what arrives, or NCCL's own all-reduce beside them.

    comm = ringcomm.nccl.NcclCommunicator(store, rank, world_size)  # on torch.cuda.current_device()
    comm.all_reduce(t)                         # algorithm="auto" | "ring" | "tree" |
                                               # "recursive_doubling" | "nccl" (NCCL's own)
    comm.all_gather(out, t)                    # the ring's all-gather
    comm.all_reduce_coalesced(tensors)         # fused: packed by ringcomm's kernels, one all_reduce
    comm.sparse_all_reduce(indices, values, n) # top-k exchange: pairs gathered, scatter-added
    comm.synchronize(timeout=60)               # a failed peer raises instead of hanging
    comm.close()

Every call enqueues work on the tensor's current CUDA stream and returns, as torch's own NCCL
collectives do. NCCL allows one rank per GPU in a communicator.

NCCL is loaded when the first communicator (or unique id) is made, not at import: from
RINGCOMM_NCCL_LIBRARY if set, else the nvidia-nccl wheel that torch's CUDA builds bring, else
libnccl.so.2 from the dynamic loader's path.
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from typing import Optional

import torch

from . import cuda
from ._buffers import TORCH_DTYPES, op_code
from ._env import env_string

ALGORITHMS = {"auto": 0, "ring": 1, "tree": 2, "recursive_doubling": 3, "nccl": 11}


def library_path() -> str:
    """The NCCL library that ringcomm loads (see the module's docstring)."""
    explicit = env_string("RINGCOMM_NCCL_LIBRARY")
    if explicit:
        return explicit
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:  # no nvidia namespace package at all
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(candidate):
            return candidate
    return "libnccl.so.2"


def _extension():
    try:
        from . import _C_cuda
    except ImportError as e:
        raise RuntimeError(
            f"ringcomm was built without its CUDA extension ({e}): reinstall with "
            "nvcc on PATH or RINGCOMM_CUDA=1"
        ) from e
    return _C_cuda


def unique_id() -> bytes:
    """A new NCCL communicator id (ncclGetUniqueId): made by one rank, shared with the others.
    Needs the NCCL library, not a GPU."""
    return _extension().nccl_unique_id(library_path())


class NcclCommunicator:
    """`world_size` ranks, one CUDA device each, joined through `store` (a torch.distributed
    Store): rank 0 makes the NCCL id and publishes it under `name`, the others read it. Blocks
    until every rank has joined."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        device: Optional[torch.device] = None,
        name: str = "ringcomm-nccl",
        timeout: timedelta = timedelta(minutes=10),
    ):
        _, reason = cuda._load()
        if reason:
            raise RuntimeError(f"no NCCL communicator: {reason}")
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device must be a CUDA device with an index, got {self.device}")
        self.timeout = timeout
        # A communicator made again under the same name (after an abort) must not read the id
        # of the one before: every rank's join is counted, and each world_size joins make one
        # generation (a generation's ranks all join before any can start the next).
        generation = (store.add(f"{name}/joins", 1) - 1) // world_size
        key = f"{name}/{generation}/unique_id"
        if rank == 0:
            store.set(key, unique_id())
        store.wait([key], timeout)
        self._transport = _extension().nccl_communicator(
            library_path(), store.get(key), rank, world_size, self.device.index
        )
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor: torch.Tensor, op="sum", algorithm: str = "auto") -> torch.Tensor:
        """In place, enqueued on the current stream of the tensor's device. "auto": recursive
        doubling up to 256 KiB, the ring above (not calibrated on a GPU yet)."""
        code = ALGORITHMS.get(algorithm)
        if code is None:
            raise ValueError(
                f"unknown algorithm {algorithm!r}; expected one of " + ", ".join(ALGORITHMS)
            )
        cuda._check(tensor, "tensor", device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._transport.all_reduce(
            tensor.data_ptr(), tensor.numel(), TORCH_DTYPES[tensor.dtype], op_code(op), code, stream
        )
        return tensor

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """output (world_size x input.numel() elements, flat or not) gets every rank's input, in
        rank order, by the ring all-gather's step list over NCCL."""
        n = input.numel()
        cuda._check(input, "input", device=self.device)
        cuda._check(output, "output", (input.dtype,), device=self.device)
        if output.numel() != n * self.world_size:
            raise ValueError(f"output has {output.numel()} elements for {self.world_size} x {n}")
        flat = output.view(-1)
        flat[self.rank * n : (self.rank + 1) * n].copy_(input.view(-1))
        self._all_gather_blocks(flat, [n] * self.world_size)
        return output

    def _all_gather_blocks(self, flat: torch.Tensor, counts: list) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._transport.all_gather(flat.data_ptr(), counts, TORCH_DTYPES[flat.dtype], stream)

    def all_reduce_coalesced(self, tensors, op="sum", algorithm: str = "auto") -> None:
        """Each tensor reduced in place: packed back to back by ringcomm's pack kernel (one
        dtype), one all_reduce, unpacked."""
        if not tensors:
            return
        flat = cuda.pack(tensors)
        self.all_reduce(flat, op, algorithm)
        cuda.unpack(flat, tensors)

    def sparse_all_reduce(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        numel: int,
        out: Optional[torch.Tensor] = None,
        op="sum",
    ) -> torch.Tensor:
        """Dense sum (op="avg": average) over ranks of every rank's (int32 indices, values)
        pairs, into `out` (default a new float32 tensor of numel elements), returned: the counts
        of pairs are exchanged first (one host synchronisation, so that ranks may send different
        numbers), the pairs gathered by the ring's all-gather, then added rank by rank with
        ringcomm's scatter-add kernel (indices distinct within a rank, as top-k gives them), in
        the same order on every rank."""
        if op not in ("sum", "avg"):
            raise ValueError(f"sparse_all_reduce sums or averages, got op {op!r}")
        cuda._check(indices, "indices", (torch.int32,), device=self.device)
        cuda._check(values, "values", cuda.TOPK_DTYPES, device=self.device)
        if indices.numel() != values.numel():
            raise ValueError(f"{indices.numel()} indices but {values.numel()} values")
        numel = int(numel)
        out = torch.empty(numel, dtype=torch.float32, device=self.device) if out is None else out
        cuda._check(out, "out", cuda.TOPK_DTYPES, device=self.device)
        if out.numel() != numel:
            raise ValueError(f"out has {out.numel()} elements, expected numel = {numel}")
        counts = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        counts[self.rank] = indices.numel()
        self._all_gather_blocks(counts, [1] * self.world_size)
        counts = counts.tolist()  # waits for the exchange
        starts = [sum(counts[:r]) for r in range(self.world_size)]
        all_indices = torch.empty(sum(counts), dtype=torch.int32, device=self.device)
        all_values = torch.empty(sum(counts), dtype=out.dtype, device=self.device)
        mine = slice(starts[self.rank], starts[self.rank] + counts[self.rank])
        all_indices[mine].copy_(indices.view(-1))
        all_values[mine].copy_(values.view(-1))
        self._all_gather_blocks(all_indices, counts)
        self._all_gather_blocks(all_values, counts)
        dense = out.view(-1)
        dense.zero_()
        for r in range(self.world_size):
            part = slice(starts[r], starts[r] + counts[r])
            cuda.scatter_add_(dense, all_indices[part], all_values[part])  # checks indices
        if op == "avg":
            dense.div_(self.world_size)
        return out

    def synchronize(self, timeout: Optional[timedelta] = None) -> None:
        """Waits for this communicator's work on the current stream. A peer that failed, or the
        deadline (default: the communicator's timeout), raises RingcommError and aborts the
        communicator."""
        timeout = self.timeout if timeout is None else timeout
        self._transport.synchronize(
            torch.cuda.current_stream(self.device).cuda_stream, timeout.total_seconds()
        )

    def close(self) -> None:
        """Frees the NCCL communicator (after its work is done)."""
        self._transport.close()

    def abort(self) -> None:
        """Drops the NCCL communicator at once, unfinished work included."""
        self._transport.abort()
