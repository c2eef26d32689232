"""GradientAverager: averages .grad over all ranks in fused buckets, for training loops without DDP.

averager = ringcomm.GradientAverager(model.parameters(), comm, compression="bf16")
for batch in data:
    loss = model(batch).sum()
    loss.backward()           # buckets start as soon as all their gradients are ready
    averager.step()           # waits: every .grad now holds the average over all ranks
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib

import torch

from . import _C
from ._buffers import TORCH_DTYPES, op_code
from .compress import Bucket, Compressor
from .fusion import DEFAULT_BUCKET_BYTES, FLOAT32, BufferList, check_bucket_bytes

COMPRESSION = {
    None: FLOAT32,
    "fp16": TORCH_DTYPES[torch.float16],
    "bf16": TORCH_DTYPES[torch.bfloat16],
}
SUM = op_code("sum")


class GradientAverager:
    """Averages the gradients of `params` over the ranks of `comm`.

    Parameters are cut into buckets of at most `bucket_bytes` (on the wire), in reverse order,
    the order in which backward usually produces their gradients. A hook on each parameter
    (register_post_accumulate_grad_hook) starts a bucket's fused all-reduce as soon as all of its
    gradients are accumulated, in bucket order on every rank, so communication overlaps the rest
    of backward; step() starts what is left (a parameter without a gradient contributes zeros and
    gets the average) and waits. Until step() returns, a started bucket's gradients are being
    rewritten in the background: read them after it.

    Values are multiplied by 1/world_size as they are packed and then summed, as DDP does, so the
    averages are DDP's: bitwise with two ranks (one addition per element), and to rounding with
    more (the order of the additions differs). `compression` "fp16" or "bf16" sends float32
    gradients in that format (rounded once, after the scaling), and unpacks the sums back to
    float32; other dtypes travel as they are. A Compressor (ringcomm.compress) as `compression`
    averages each bucket as its DDP hook does, its memory kept per bucket and its step counting
    step() calls: a `ringcomm.hooks.TopKState` sends the bucket's top-k with error feedback, like
    topk_hook (the bucket's gradients flattened into one tensor); a
    `ringcomm.hooks.QuantizeState` sends it as 8-bit codes with error feedback, like
    quantize_hook; a `ringcomm.hooks.PowerSGDState` sends it as powersgd_hook does: its matrices
    as low-rank factors with error feedback, its vectors and small matrices whole; any other
    Compressor as compressor_hook would. Until step() returns, issue nothing else on `comm`
    (PowerSGD, the quantizer and top-k issue part of their all-reduces from the progress thread).
    """

    def __init__(self, params, comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES, compression=None):
        self._compressor = compression if isinstance(compression, Compressor) else None
        if self._compressor is None and compression not in COMPRESSION:
            raise ValueError(
                f"compression must be None, 'fp16', 'bf16' or a "
                f"ringcomm.compress.Compressor (ringcomm.hooks.TopKState, "
                f"QuantizeState, PowerSGDState, ...), got {compression!r}"
            )
        self._comm = comm
        self._wire = FLOAT32 if self._compressor is not None else COMPRESSION[compression]
        self._bucket_bytes = check_bucket_bytes(bucket_bytes)
        unique, seen = [], set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
            if not (p.requires_grad and p.is_leaf):
                raise ValueError(f"params[{i}] must be a leaf tensor that requires grad")
            if p.device.type not in ("cpu", "cuda") or not p.dtype.is_floating_point:
                raise ValueError(
                    f"params[{i}] must be a floating CPU or CUDA tensor, got "
                    f"{p.dtype} on {p.device}"
                )
            if unique and p.device != unique[0].device:
                raise ValueError(
                    f"params[{i}] is on {p.device}, params[0] on "
                    f"{unique[0].device}: one device per GradientAverager"
                )
            if id(p) not in seen:  # shared parameters are averaged once
                seen.add(id(p))
                unique.append(p)
        if self._compressor is not None and unique:
            self._compressor.check_device(unique[0].device)
        self._buckets = self._make_buckets(unique[::-1])
        self._bucket_of = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket}
        self._missing = [len(bucket) for bucket in self._buckets]  # gradients not yet ready
        self._ready = set()  # ids of parameters whose gradient is ready this step
        self._works = []
        self._syncing = True
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in unique]

    def _make_buckets(self, params):
        """Consecutive parameters of one dtype, at most bucket_bytes on the wire (a larger
        parameter gets a bucket of its own)."""
        buckets, size = [], 0
        for p in params:
            wire_size = (
                2 if p.dtype == torch.float32 and self._wire != FLOAT32 else p.element_size()
            )
            nbytes = p.numel() * wire_size
            if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > self._bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        return buckets

    @property
    def buckets(self):
        """The parameters of each bucket, in the order the buckets are started."""
        return [list(bucket) for bucket in self._buckets]

    @property
    def launched(self) -> int:
        """Buckets started since the last step()."""
        return len(self._works)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulated inside are not sent: for gradient accumulation over several
        backward passes, the last of them outside this block."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _on_grad_ready(self, p):
        if not self._syncing:
            return
        if id(p) in self._ready:
            raise RuntimeError(
                "a gradient was accumulated twice before GradientAverager.step(): its bucket may "
                "already be on the wire. Call step() after each backward, or accumulate inside "
                "averager.no_sync()"
            )
        self._ready.add(id(p))
        b = self._bucket_of[id(p)]
        self._missing[b] -= 1
        while self.launched < len(self._buckets) and self._missing[self.launched] == 0:
            self._launch(self.launched)  # in bucket order, the same on every rank

    def _launch(self, b):
        grads = []
        for p in self._buckets[b]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                raise TypeError("GradientAverager averages dense gradients; got a sparse one")
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            grads.append(p.grad)
        if self._compressor is not None:
            # a Future with the flat average, or once the grads hold it None (CUDA: the grads)
            average = self._compressor.average(self._comm, Bucket(grads, b))
            self._works.append((average, grads, torch.futures.Future.value))
            return
        if grads[0].is_cuda:
            self._works.append(self._launch_cuda(grads))
            return
        bufs = BufferList(grads, "gradients")
        work = _C.all_reduce_coalesced(
            self._comm._core,
            bufs.ptrs,
            bufs.counts,
            bufs.dtypes,
            SUM,
            self._bucket_bytes,
            self._wire,
            1.0 / self._comm.world_size,
            True,
        )
        self._works.append((work, grads, None))  # the gradients stay alive until it is done

    def _launch_cuda(self, grads):
        """A bucket of CUDA gradients: packed on the GPU (scaled by 1/world_size, cast to the wire
        dtype), summed through the communicator's staged all_reduce, unpacked in step()."""
        dtype = grads[0].dtype
        wire = {
            FLOAT32: dtype,
            COMPRESSION["fp16"]: torch.float16,
            COMPRESSION["bf16"]: torch.bfloat16,
        }[self._wire]
        if dtype != torch.float32:
            wire = dtype  # the compressions are for float32 gradients, as on the CPU
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / self._comm.world_size)
        flat = flat.to(wire)
        work = self._comm.all_reduce(flat, op="sum", async_op=True)
        return work, grads, lambda work: work.result().to(dtype)

    def step(self):
        """Starts the buckets backward has not, waits for all, and readies the next step. Every
        .grad then holds the average over all ranks."""
        try:
            for b in range(self.launched, len(self._buckets)):
                self._launch(b)
            for work, grads, result in self._works:
                work.wait()  # a Work, or a compressor's Future: both raise the operation's error
                averaged = None if result is None else result(work)
                if isinstance(averaged, torch.Tensor):  # the average comes back flat
                    for g, piece in zip(grads, torch.split(averaged, [g.numel() for g in grads])):
                        g.copy_(piece.view_as(g))
            if self._works and self._compressor is not None:
                self._compressor.end_step(self._comm)
        finally:
            self._works = []
            self._ready.clear()
            self._missing = [len(bucket) for bucket in self._buckets]

    def remove(self):
        """Removes the hooks from the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
