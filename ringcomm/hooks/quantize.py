"""8-bit quantization with error feedback over the plain all-reduce, as a DDP communication hook.

    state = ringcomm.hooks.QuantizeState()            # rounding="stochastic" for unbiased codes
    ddp.register_comm_hook(state, ringcomm.hooks.quantize_hook)

Each bucket travels as one byte per element, in two all-reduces (the scheme:
csrc/kernels/quantize_math.h):

    acc = grad + residual; per chunk of `chunk` elements, (-min, max) of acc;
    all-reduce(ranges, max): every rank has each chunk's [lo, hi];
    step = (hi - lo) / (255 // world); code = floor((acc - lo) / step + 1/2);
    residual = acc - (lo + code step);
    all-reduce(codes, sum) as uint8: the ranks' codes add up to at most 255, exactly;
    average = lo + step (sum / world)

Every rank uses the same scale and the integer sum is exact whatever the algorithm and its order
of additions, so the average is the same bits on every rank and on every run, however the probe
timed the machine. A dense exchange (all the elements, one byte each: a quarter of float32's
bytes, half of bfloat16's) where top-k's sparse exchange does not pay. The second all-reduce is
issued from the first one's completion; a bucket starts its first only after the bucket before
has issued its second (compress.Lane), so every rank issues them in one order.

This module must not use `from __future__ import annotations` (see default.py: DDP compares the
hook's annotations as objects).
"""

from dataclasses import dataclass, field
from typing import Optional

import torch

import torch.distributed as dist

from .. import compress, trace
from ..compress import Bucket, Compressor, Dense, Lane
from .compressor import run_compressor
from .state import ReportsBuckets, ringcomm_named

ROUNDINGS = ("nearest", "stochastic")


@dataclass
class _Quantized:
    """One bucket on its way: `flat`, its gradient (where the average lands); `source`, what is
    quantized (the residual after error feedback, else flat); `error`, where what the codes lose
    goes (the residual, or None); `ranges` and `levels`; `key`, the stochastic rounding's
    stream (None: nearest); `codes`, once quantized."""

    flat: torch.Tensor
    source: torch.Tensor
    error: Optional[torch.Tensor]
    ranges: torch.Tensor
    levels: int
    key: Optional[int]
    codes: Optional[torch.Tensor] = None


@dataclass(eq=False)
class QuantizeState(ReportsBuckets, Compressor):
    """Configuration, per-bucket memory and the Compressor of quantize_hook (and of a
    GradientAverager given it as `compression`).

    chunk: elements that share one scale (their agreed min and max): 8 bytes of ranges per chunk
    go in the first all-reduce.
    rounding: "nearest" (ties up) or "stochastic": u uniform in [0, 1) instead of 1/2, drawn
    from (seed, rank, bucket slot, step, element index) alone, so a run replays.
    error_feedback: add what quantization lost to the next step's gradient (per bucket, following
    its parameters when DDP rebuilds its buckets).
    seed: the stochastic rounding's streams.
    comm: a ringcomm Communicator or ringcomm process group (None: created from the default
    process group's store on first use).

    With n ranks each rank's codes take 255 // n + 1 values (n = 4: 64, n = 8: 32), so that their
    sum fits a byte; at most 255 ranks.
    """

    chunk: int = compress.QUANTIZE_CHUNK
    rounding: str = "nearest"
    error_feedback: bool = True
    seed: int = 0
    _lane: Optional[Lane] = field(
        default_factory=lambda: Lane("8-bit quantization"), repr=False, kw_only=True
    )

    SETTINGS = ("chunk", "rounding", "error_feedback", "seed")

    def __post_init__(self):
        if int(self.chunk) < 1:
            raise ValueError(f"chunk must be at least 1 element, got {self.chunk}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

    @property
    def residuals(self) -> dict:
        """Error feedback's residual per bucket slot."""
        return self.memory.named("residuals")

    def state_dict(self) -> dict:
        """Everything needed to resume (no communicator inside)."""
        state = {key: getattr(self, key) for key in self.SETTINGS}
        state.update(step=self.step, residuals={i: t.clone() for i, t in self.residuals.items()})
        return state

    def load_state_dict(self, state: dict):
        for key in self.SETTINGS + ("step",):
            setattr(self, key, state[key])
        self.memory.load_state_dict({"residuals": state["residuals"]})
        self.__post_init__()

    # -- the Compressor -------------------------------------------------------------------------

    def compress(self, comm, bucket: Bucket):
        """Error feedback and the bucket's chunk ranges; other dtypes go whole."""
        flat = bucket.gradient()
        if flat.dtype not in compress.QUANTIZE_DTYPES:
            return Dense(flat, f"{flat.dtype} is not quantized")
        levels = compress.CODE_SUM // comm.world_size
        if levels < 1:
            raise ValueError(
                f"8-bit codes of {comm.world_size} ranks do not sum within a byte: "
                f"QuantizeState averages at most {compress.CODE_SUM} ranks"
            )
        with trace.span("compress", numel=flat.numel()):
            residual = self.memory.get("residuals", bucket, flat) if self.error_feedback else None
            ranges = compress.quantize_ranges(flat, residual, self.chunk)
        key = None
        if self.rounding == "stochastic":
            key = compress.rank_key(self.seed, comm.rank, bucket.slot, self.step)
        source = flat if residual is None else residual
        return _Quantized(flat, source, residual, ranges, levels, key)

    def exchange(self, comm, bucket: Bucket, q: _Quantized) -> torch.futures.Future:
        """The ranges all-reduced with max, then the codes with sum, in the lane's order."""

        def agree(_):
            return self._count(comm, bucket, comm.all_reduce(q.ranges, op="max", async_op=True))

        def send(ranges):
            compress.held_here(q.ranges)
            with trace.span("quantize", numel=q.source.numel()):
                q.codes = compress.quantize(
                    q.source, ranges, self.chunk, q.levels, error=q.error, key=q.key
                )
            return self._count(comm, bucket, comm.all_reduce(q.codes, op="sum", async_op=True))

        return compress.rounds(comm, self._lane, [agree, send], bucket.device)

    def decompress(self, comm, bucket: Bucket, q: _Quantized, sums: torch.Tensor) -> torch.Tensor:
        """The mean, into the bucket's gradient: shaped like bucket.flat, where given."""
        compress.held_here(q.ranges)
        average = compress.dequantize_mean(
            sums, q.ranges, self.chunk, q.levels, comm.world_size, out=q.flat
        )
        return average if bucket.flat is None else average.view_as(bucket.flat)

    @staticmethod
    def _count(comm, bucket: Bucket, work):
        if bucket.index is not None:
            comm.bucket_stats.add_work(bucket.index, work)
        return work


@ringcomm_named
def quantize_hook(
    state: QuantizeState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: 8-bit quantization with error feedback over two all-reduces (see
    QuantizeState)."""
    if not isinstance(state, QuantizeState):
        raise TypeError(
            f"quantize_hook needs a ringcomm.hooks.QuantizeState, got {type(state).__name__}"
        )
    return run_compressor(state, bucket)
