"""Top-k gradient compression with error feedback, as a DDP communication hook.

    state = ringcomm.hooks.TopKState(ratio=0.01)
    ddp.register_comm_hook(state, ringcomm.hooks.topk_hook)

Each bucket sends only its k = ratio * numel largest-magnitude entries (int32 index + value) and
keeps what it did not send in a per-bucket residual that is added to the next step's gradient
(error feedback), so nothing is lost, only delayed. The exchange is ringcomm's sparse all-reduce
(all-gather of pairs, or a range-partitioned sparse reduce-scatter, or dense, by a cost estimate).

This module must not use `from __future__ import annotations` (see default.py: DDP compares the
hook's annotations as objects).
"""
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

import torch.distributed as dist

from .. import compress
from .default import _completed, _ringcomm_named
from .state import communicator_for


@dataclass
class TopKStats:
    """Running totals since the state was created (or reset)."""

    steps: int = 0
    compressed_buckets: int = 0
    dense_buckets: int = 0
    bytes_sent: int = 0             # measured on this rank's connections
    dense_bytes: int = 0            # what a ring all-reduce of the same buckets would have sent
    compress_seconds: float = 0.0   # error feedback + top-k selection
    exchange_seconds: float = 0.0   # submit to result, sparse decode (scatter-add) included

    @property
    def compression_ratio(self) -> float:
        """Dense bytes over bytes actually sent (warm-up steps included)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")


@dataclass
class TopKState:
    """Configuration and per-bucket memory of topk_hook.

    ratio: fraction of each bucket's entries sent. error_feedback: keep unsent entries for later.
    warmup_steps: iterations of plain dense averaging first (DDP also rebuilds its buckets after
    the first iteration). min_numel: smaller buckets always go dense. value_dtype: wire type of the
    values (float32, float16, bfloat16); the rounding error goes into the residual.
    momentum_correction: Deep Gradient Compression's local momentum (use with a momentum-free
    optimizer); `momentum` is its factor. comm: a ringcomm Communicator (default: created from the
    default process group's store on first use).
    """

    ratio: float = 0.01
    error_feedback: bool = True
    warmup_steps: int = 10
    min_numel: int = 1024
    value_dtype: torch.dtype = torch.float32
    momentum_correction: bool = False
    momentum: float = 0.9
    comm: Optional[object] = None
    step: int = 0
    residuals: dict = field(default_factory=dict)
    velocities: dict = field(default_factory=dict)
    stats: TopKStats = field(default_factory=TopKStats)
    _step_start_bytes: Optional[int] = None
    _param_slots: dict = field(default_factory=dict)  # compiled DDP: id(param) -> memory slot

    def slot_of(self, bucket, comm):
        """(gradient, memory slot, last of the step?) for a GradBucket or a (grad, param) tuple.

        Compiled DDP calls the hook per parameter with no "last" flag: there the first
        parameter's call coming round again is what ends the previous step."""
        if isinstance(bucket, tuple):
            grad, param = bucket
            slot = self._param_slots.setdefault(id(param), len(self._param_slots))
            if slot == 0 and self._step_start_bytes is not None:
                self.end_step(comm)
            return grad, slot, False
        return bucket.buffer(), bucket.index(), bucket.is_last()

    def end_step(self, comm):
        self.stats.bytes_sent += comm.bytes_sent - self._step_start_bytes
        self._step_start_bytes = None
        self.step += 1
        self.stats.steps += 1

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if self.value_dtype not in compress.TOPK_DTYPES:
            raise TypeError(f"value_dtype must be one of {compress.TOPK_DTYPES}, got {self.value_dtype}")
        if self.warmup_steps < 0 or self.min_numel < 0:
            raise ValueError("warmup_steps and min_numel must be >= 0")

    def memory(self, store: dict, index: int, like: torch.Tensor) -> torch.Tensor:
        """The per-bucket tensor kept in `store`, reset when the bucket's shape or dtype changed
        (DDP rebuilds buckets after its first iterations)."""
        t = store.get(index)
        if t is None or t.shape != like.shape or t.dtype != like.dtype:
            t = torch.zeros_like(like, memory_format=torch.contiguous_format)
            store[index] = t
        return t

    def state_dict(self) -> dict:
        """Everything needed to resume (no communicator inside)."""
        return {"ratio": self.ratio, "error_feedback": self.error_feedback,
                "warmup_steps": self.warmup_steps, "min_numel": self.min_numel,
                "value_dtype": self.value_dtype, "momentum_correction": self.momentum_correction,
                "momentum": self.momentum, "step": self.step,
                "residuals": {i: t.clone() for i, t in self.residuals.items()},
                "velocities": {i: t.clone() for i, t in self.velocities.items()}}

    def load_state_dict(self, state: dict):
        for key in ("ratio", "error_feedback", "warmup_steps", "min_numel", "value_dtype",
                    "momentum_correction", "momentum", "step"):
            setattr(self, key, state[key])
        self.residuals = {int(i): t.clone() for i, t in state["residuals"].items()}
        self.velocities = {int(i): t.clone() for i, t in state["velocities"].items()}
        self.__post_init__()


def average_compressed(state: TopKState, comm, flat: torch.Tensor, slot: int):
    """Starts averaging the flat gradient `flat` over the ranks of `comm`: dense during warm-up
    (or for small buckets and other dtypes), else its top-k with error feedback through the
    sparse all-reduce. Returns (Work whose result is the flat average, a function to call with
    that result when it is ready, which does the bookkeeping and returns it). `slot` names the
    residual/velocity memory. Shared by topk_hook and GradientAverager."""
    stats = state.stats
    if state._step_start_bytes is None:
        state._step_start_bytes = comm.bytes_sent
    numel = flat.numel()
    stats.dense_bytes += 2 * (comm.world_size - 1) * numel * flat.element_size() // comm.world_size
    source = flat if flat.is_contiguous() else flat.contiguous()
    started = time.perf_counter()
    if state.step < state.warmup_steps or numel < state.min_numel or \
            flat.dtype not in compress.TOPK_DTYPES:
        stats.dense_buckets += 1
        work = comm.all_reduce(source, op="avg", async_op=True)
    else:
        k = max(1, int(numel * state.ratio))
        if state.momentum_correction:
            velocity = state.memory(state.velocities, slot, source)
            velocity.mul_(state.momentum).add_(source)
            source = velocity
        if state.error_feedback:
            residual = state.memory(state.residuals, slot, source)
            values, indices = compress.topk_with_residual(source, residual, k)
        else:
            values, indices = compress.topk(source, k)
        if state.momentum_correction:
            source.index_fill_(0, indices.long(), 0)  # DGC's momentum factor masking
        wire_values = values.to(state.value_dtype)
        if state.error_feedback and wire_values.dtype != values.dtype:
            # what rounding to the wire type lost is owed too
            residual.index_add_(0, indices.long(), values - wire_values.to(values.dtype))
        stats.compressed_buckets += 1
        stats.compress_seconds += time.perf_counter() - started
        started = time.perf_counter()
        out = torch.empty(numel, dtype=flat.dtype)
        work = comm.sparse_all_reduce(indices, wire_values, numel, out=out, op="avg", async_op=True)

    def finished(result: torch.Tensor) -> torch.Tensor:
        stats.exchange_seconds += time.perf_counter() - started
        return result

    return work, finished


@_ringcomm_named
def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: sparse top-k exchange with error feedback (dense during warm-up)."""
    if not isinstance(state, TopKState):
        raise TypeError(f"topk_hook needs a ringcomm.hooks.TopKState, got {type(state).__name__}")
    comm = communicator_for(state.comm)
    grad, slot, is_last = state.slot_of(bucket, comm)
    work, finished = average_compressed(state, comm, grad.reshape(-1), slot)

    def finish(result: torch.Tensor) -> torch.Tensor:
        finished(result)
        if is_last:
            state.end_step(comm)
        return result.view_as(grad)

    if isinstance(bucket, tuple):  # compiled DDP discards the future: finish in place now
        work.wait()
        return _completed(grad.copy_(finish(work.result())))
    return work.get_future().then(lambda fut: finish(fut.value()))
