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

from .. import compress, trace
from ..compress import Bucket, Compressor
from .state import ReportsBuckets, communicator_for, completed, ringcomm_named


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
class _Compressed:
    """What one bucket sends: its flat gradient, and either `dense` (the gradient plus what it is
    owed, all-reduced whole) or its top-k `indices` and wire `values`; `started`, when the
    exchange's time (TopKStats.exchange_seconds) began."""

    flat: torch.Tensor
    started: float
    dense: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


@dataclass
class TopKState(ReportsBuckets, Compressor):
    """Configuration, per-bucket memory and the Compressor of topk_hook (and of a
    GradientAverager given it as `compression`).

    The defaults are the measured good settings (docs/performance.md, Top-k compression,
    "Quality"):

    ratio: fraction of each bucket's entries sent once the warm-up is over.
    dense_steps: first iterations averaged densely. Residuals and velocities are kept per
    bucket and follow their parameters when DDP rebuilds its buckets after the first iteration.
    warmup_steps, warmup_density: Deep Gradient Compression's sparsity warm-up: the density
    starts at warmup_density and is divided by 4 at each stage (93.75%, 98.4%, 99.6% sparsity,
    ...) until it reaches ratio; the stages share warmup_steps equally (0: ratio from the start).
    error_feedback: keep unsent entries (and value rounding) for later steps.
    adaptive: a bucket goes dense when the cost model puts its dense all-reduce at no more than
    its sparse exchange (Communicator.compression_costs: small buckets, where dense takes fewer
    rounds, and high densities); the same choice on every rank. False: every floating bucket is
    compressed.
    value_dtype: wire type of the values (float32, float16, bfloat16).
    momentum_correction, momentum: Deep Gradient Compression's local momentum with factor
    masking; the optimizer must then not apply momentum itself: take_momentum(optimizer) moves
    it from a torch SGD optimizer into this state.
    clip_norm: local gradient clipping: each rank scales a bucket's gradient down to an L2 norm
    of at most clip_norm / sqrt(world_size) before accumulating it (None: off).
    comm: a ringcomm Communicator (default: created from the default process group's store on
    first use).
    """

    ratio: float = 0.01
    dense_steps: int = 1
    warmup_steps: int = 20
    warmup_density: float = 0.0625
    error_feedback: bool = True
    adaptive: bool = True
    value_dtype: torch.dtype = torch.bfloat16
    momentum_correction: bool = False
    momentum: float = 0.9
    clip_norm: Optional[float] = None
    comm: Optional[object] = None
    step: int = 0
    residuals: dict = field(default_factory=dict)
    velocities: dict = field(default_factory=dict)
    stats: TopKStats = field(default_factory=TopKStats)
    _step_start_bytes: Optional[int] = None
    _param_slots: dict = field(default_factory=dict)  # compiled DDP: id(param) -> memory slot
    _layouts: dict = field(default_factory=dict)  # (memory name, slot) -> its bucket's layout
    _retired: list = field(default_factory=list)  # memories replaced this step, for their pieces
    _prepared: list = field(default_factory=list)  # [zeroed block, elements handed out]

    SETTINGS = ("ratio", "dense_steps", "warmup_steps", "warmup_density", "error_feedback",
                "adaptive", "value_dtype", "momentum_correction", "momentum", "clip_norm")

    def slot_of(self, bucket, comm):
        """(gradient, memory slot, last of the step?, layout for memory()) for a GradBucket or a
        (grad, param) tuple.

        Compiled DDP calls the hook per parameter with no "last" flag: there the first
        parameter's call coming round again is what ends the previous step."""
        if isinstance(bucket, tuple):
            grad, param = bucket
            slot = self._param_slots.setdefault(id(param), len(self._param_slots))
            if slot == 0 and self._step_start_bytes is not None:
                self.end_step(comm)
            return grad, slot, False, None
        layout = tuple((id(p), p.numel()) for p in bucket.parameters())
        return bucket.buffer(), bucket.index(), bucket.is_last(), layout

    def end_step(self, comm):
        self.stats.bytes_sent += comm.bytes_sent - self._step_start_bytes
        self._step_start_bytes = None
        self._retired.clear()
        if self.step >= self.dense_steps:
            self._prepared.clear()  # what the first compressed step did not take
        self.step += 1
        self.stats.steps += 1

    def prepare_memory(self, like: torch.Tensor) -> None:
        """Zeroed memory for the residuals of the next step, the first compressed one, shaped
        like `like` (a bucket's gradient): called on the last dense step, after its all-reduce
        has started, so that faulting in the pages (16.9 MB for the digits MLP's big bucket,
        4,100 page faults, 100 ms of a 4-rank host's first compressed step) overlaps the wait
        for the network. DDP rebuilds its buckets after the first iteration; the rebuilt ones
        have the same elements in all, so memory() carves their residuals out of these blocks.
        A block stays allocated whole while any residual carved out of it lives (a bucket that
        goes dense instead leaves its part unused)."""
        self._prepared.append([torch.zeros_like(like, memory_format=torch.contiguous_format), 0])

    def _zeros(self, like: torch.Tensor) -> torch.Tensor:
        """Zeros shaped like the flat tensor `like`: a slice of a prepared block while they
        last, else new."""
        numel = like.numel()
        for block in self._prepared:
            t, used = block
            if t.dtype == like.dtype and t.device == like.device and t.numel() - used >= numel:
                block[1] = used + numel
                return t[used:used + numel]
        return torch.zeros_like(like, memory_format=torch.contiguous_format)

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if not 0 < self.warmup_density <= 1:
            raise ValueError(f"warmup_density must be in (0, 1], got {self.warmup_density}")
        if self.value_dtype not in compress.TOPK_DTYPES:
            raise TypeError(f"value_dtype must be one of {compress.TOPK_DTYPES}, got {self.value_dtype}")
        if self.dense_steps < 0 or self.warmup_steps < 0:
            raise ValueError("dense_steps and warmup_steps must be >= 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {self.clip_norm}")

    def density(self, step: Optional[int] = None) -> float:
        """Fraction of entries sent at `step` (default: the current step); 1 for dense steps."""
        step = self.step if step is None else step
        if step < self.dense_steps:
            return 1.0
        stages = 0  # densities warmup_density / 4**i above ratio
        while self.warmup_density / 4 ** stages > self.ratio:
            stages += 1
        ramp_step = step - self.dense_steps
        if stages == 0 or ramp_step >= self.warmup_steps:
            return self.ratio
        return self.warmup_density / 4 ** (ramp_step * stages // self.warmup_steps)

    def take_momentum(self, optimizer) -> None:
        """Moves momentum from a torch SGD-style optimizer into this state (Deep Gradient
        Compression's momentum correction and factor masking): the hook then accumulates the
        velocity locally, before compression, and the optimizer is left to apply plain updates.
        Every parameter group must share one momentum, with no dampening, no Nesterov and no
        weight decay (which would then be applied outside the momentum)."""
        groups = optimizer.param_groups
        momenta = {g.get("momentum", 0) for g in groups}
        if len(momenta) != 1 or not 0 < next(iter(momenta)) < 1:
            raise ValueError(f"take_momentum needs one momentum in (0, 1) shared by every "
                             f"parameter group, got {sorted(momenta)}")
        for g in groups:
            if g.get("dampening", 0) or g.get("nesterov", False) or g.get("weight_decay", 0):
                raise ValueError("take_momentum supports SGD momentum without dampening, Nesterov "
                                 "or weight decay")
        self.momentum = next(iter(momenta))
        self.momentum_correction = True
        for g in groups:
            g["momentum"] = 0

    def memory(self, name: str, index: int, like: torch.Tensor, layout=None) -> torch.Tensor:
        """The per-bucket tensor kept in the dict `name` ("residuals" or "velocities") for slot
        `index`, shaped like `like`. `layout`, the bucket's parameters as ((id, numel), ...) in
        order, lets what was kept survive DDP's rebuild of its buckets after the first iteration:
        a bucket whose parameters changed gets each parameter's piece from wherever it was kept.
        Without a layout, a change of shape or dtype starts the memory at zero."""
        store = getattr(self, name)
        t, known = store.get(index), self._layouts.get((name, index))
        if t is not None and t.shape == like.shape and t.dtype == like.dtype and \
                (layout is None or known is None or known == layout):
            if layout is not None:
                self._layouts[(name, index)] = layout
            return t
        fresh = self._zeros(like)
        if layout is not None:
            self._move_pieces(name, fresh, layout)
        if t is not None:
            self._retired.append((name, t, known))  # its pieces may be wanted by other slots
        store[index] = fresh
        self._layouts[(name, index)] = layout
        return fresh

    def _move_pieces(self, name: str, fresh: torch.Tensor, layout) -> None:
        kept = [(t, self._layouts.get((name, i))) for i, t in getattr(self, name).items()]
        kept += [(t, known) for n, t, known in self._retired if n == name]
        pieces = {}
        for t, known in kept:
            if known is None or t.dtype != fresh.dtype:
                continue
            offset = 0
            for pid, numel in known:
                pieces.setdefault((pid, numel), t[offset:offset + numel])
                offset += numel
        offset = 0
        for pid, numel in layout:
            piece = pieces.get((pid, numel))
            if piece is not None:
                fresh[offset:offset + numel].copy_(piece)
            offset += numel

    def state_dict(self) -> dict:
        """Everything needed to resume (no communicator inside)."""
        state = {key: getattr(self, key) for key in self.SETTINGS}
        state.update(step=self.step,
                     residuals={i: t.clone() for i, t in self.residuals.items()},
                     velocities={i: t.clone() for i, t in self.velocities.items()})
        return state

    def load_state_dict(self, state: dict):
        for key in self.SETTINGS + ("step",):
            setattr(self, key, state[key])
        self.residuals = {int(i): t.clone() for i, t in state["residuals"].items()}
        self.velocities = {int(i): t.clone() for i, t in state["velocities"].items()}
        self._layouts, self._retired, self._prepared = {}, [], []  # ids do not outlive the process
        self.__post_init__()

    # -- the Compressor: the bucket's top-k with error feedback, or the bucket whole -------------

    def compress(self, comm, bucket: Bucket) -> _Compressed:
        """Dense on dense steps, for other dtypes and where the cost model prefers it, else the
        top-k of the bucket's flat gradient with error feedback. The residual and velocity
        memory is the bucket's slot (memory())."""
        stats, slot, layout = self.stats, bucket.slot, bucket.layout
        flat = (bucket.flat.reshape(-1) if bucket.flat is not None
                else torch.cat([g.reshape(-1) for g in bucket.grads]))
        if self._step_start_bytes is None:
            self._step_start_bytes = comm.bytes_sent
        numel = flat.numel()
        world = comm.world_size
        stats.dense_bytes += 2 * (world - 1) * numel * flat.element_size() // world
        source = flat if flat.is_contiguous() else flat.contiguous()
        started = time.perf_counter()
        k = max(1, int(numel * self.density()))
        compressible = flat.dtype in compress.TOPK_DTYPES and self.step >= self.dense_steps
        if compressible and self.adaptive:
            sparse_cost, dense_cost = comm.compression_costs(numel, k, self.value_dtype, flat.dtype)
            compressible = sparse_cost < dense_cost
        if self.clip_norm is not None:
            limit = self.clip_norm / comm.world_size ** 0.5
            norm = float(torch.linalg.vector_norm(source))
            if norm > limit:
                source = source * (limit / norm)
        if self.momentum_correction and flat.is_floating_point():
            velocity = self.memory("velocities", slot, source, layout)
            velocity.mul_(self.momentum).add_(source)
            source = velocity
        if not compressible:
            if self.error_feedback and slot in self.residuals:
                source = source + self.memory("residuals", slot, source, layout)  # owed: out now
                del self.residuals[slot]
            elif source is not flat:
                source = source.clone()  # the velocity is kept; the all-reduce works in place
            stats.dense_buckets += 1
            return _Compressed(flat, started, dense=source)
        with trace.span("compress", numel=numel, k=k):
            if self.error_feedback:
                # what rounding to the wire type loses is owed too: the kernel keeps it
                residual = self.memory("residuals", slot, source, layout)
                wire_values, indices = compress.topk_with_residual(source, residual, k,
                                                                   self.value_dtype)
            else:
                values, indices = compress.topk(source, k)
                wire_values = values.to(self.value_dtype)
        if self.momentum_correction:
            source.index_fill_(0, indices.long(), 0)  # DGC's momentum factor masking
        stats.compressed_buckets += 1
        stats.compress_seconds += time.perf_counter() - started
        return _Compressed(flat, started, indices=indices, values=wire_values)

    def exchange(self, comm, bucket: Bucket, compressed: _Compressed) -> torch.futures.Future:
        """The dense all-reduce, or the sparse all-reduce of the top-k (averages, both)."""
        flat = compressed.flat
        if compressed.dense is not None:
            work = comm.all_reduce(compressed.dense, op="avg", async_op=True)
            if self.error_feedback and self.step + 1 == self.dense_steps and \
                    flat.dtype in compress.TOPK_DTYPES:
                self.prepare_memory(flat)
        else:
            compressed.started = time.perf_counter()
            # The gradient is consumed: the average can take its place (no 4-bytes-per-element
            # allocation, and its page faults, per step).
            out = flat if flat.is_contiguous() else torch.empty(flat.numel(), dtype=flat.dtype,
                                                                device=flat.device)
            work = comm.sparse_all_reduce(compressed.indices, compressed.values, flat.numel(),
                                          out=out, op="avg", async_op=True)
        if bucket.index is not None:
            comm.bucket_stats.add_work(bucket.index, work)
        return work.get_future()

    def decompress(self, comm, bucket: Bucket, compressed: _Compressed,
                   exchanged: torch.Tensor) -> torch.Tensor:
        """The average comes back whole and flat: shaped like bucket.flat, where given."""
        self.stats.exchange_seconds += time.perf_counter() - compressed.started
        return exchanged if bucket.flat is None else exchanged.view_as(bucket.flat)


@ringcomm_named
def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: top-k sparse exchange with error feedback (see TopKState for when a bucket
    goes dense)."""
    if not isinstance(state, TopKState):
        raise TypeError(f"topk_hook needs a ringcomm.hooks.TopKState, got {type(state).__name__}")
    called = time.monotonic_ns()
    comm = communicator_for(state.comm)
    grad, slot, is_last, layout = state.slot_of(bucket, comm)
    if isinstance(bucket, tuple):  # compiled DDP discards the future: finish in place now
        average = state.average(comm, Bucket([grad], slot, flat=grad)).wait()
        return completed(grad.copy_(average))
    average = state.average(comm, Bucket([grad], slot, flat=grad, layout=layout,
                                         index=bucket.index(), is_last=is_last))
    return comm.bucket_stats.watch(bucket.index(), called, average)
