"""Top-k gradient compression with error feedback, as a DDP communication hook.

    state = ringcomm.hooks.TopKState(ratio=0.01)
    ddp.register_comm_hook(state, ringcomm.hooks.topk_hook)

Each bucket sends only its k = density * numel largest-magnitude entries (int32 index + value)
and keeps what it did not send in a per-bucket residual that is added to the next step's gradient
(error feedback), so nothing is lost, only delayed. The exchange is ringcomm's sparse all-reduce
(all-gather of pairs, or a range-partitioned sparse reduce-scatter).

How dense each bucket goes follows the run's own signal (schedule "signal"): a bucket goes whole
(as 8-bit codes, QuantizeState's scheme) while its gradient energy is still
changing fast (the critical regime of Accordion, Agarwal et al. 2021), then a level sparser at a
time (warmup_density, / 4, ..., ratio) once error feedback has settled at its level, and a level
denser again when the gradient changes fast or the residual holds gradient held back
(docs/algorithms.md, "Compression"). The smallest buckets, together a small share of a step's
elements (whole_share), stay whole. The signals are summed over the ranks, so every rank decides
alike. Which buckets go whole because that is cheaper, and by which algorithms, follows their
sizes and a model every run agrees on, never the load at start (compress.sparse_choice).

This module must not use `from __future__ import annotations` (see default.py: DDP compares the
hook's annotations as objects).
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

import torch.distributed as dist

from .. import compress, trace
from ..compress import Bucket, CompressionStats, Compressor, Dense, Lane
from .compressor import run_compressor
from .state import ReportsBuckets, ringcomm_named

SCHEDULES = ("signal", "fixed")
# The signal schedule's constants: how far each measurement moves the smoothed residual signal
# (a quarter of the way) and the smoothed gradient energy (a sixteenth: one step's batch is noisy);
# the steps over which a change of gradient energy is judged; the fewest steps at a level before
# it moves, so that one measurement does not decide.
SMOOTHING = 0.25
ENERGY_SMOOTHING = 0.0625
WINDOW = 16
MIN_STEPS = 4
# The fewest code values a rank's 8-bit codes may take on the whole level (255 // world): more
# than 17 ranks send the whole level as value_dtype, coarser codes would hold gradient back.
MIN_WHOLE_LEVELS = 15


@dataclass
class TopKStats(CompressionStats):
    """Running totals since the state was created, and each bucket slot's density at its last
    step (`densities`, 1.0 where it went whole)."""

    densities: dict = field(default_factory=dict)


@dataclass
class _Sparse:
    """What one bucket sends: its flat gradient (where the average lands), its top-k `indices` and
    wire `values`, the sparse all-reduce's way, and for the signal schedule this rank's
    (residual, gradient) energies to sum over the ranks, at `density`."""

    flat: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor
    algorithm: str
    density: float
    energies: Optional[torch.Tensor] = None


@dataclass
class _Whole:
    """A bucket on the signal schedule's whole level: every element as `wire` (value_dtype), what
    that rounding lost kept in the residual, this rank's energies (None where the schedule does
    not measure them: a small bucket), and `why` it is whole."""

    flat: torch.Tensor
    wire: torch.Tensor
    energies: Optional[torch.Tensor]
    why: str
    density: float = 1.0


@dataclass
class _QuantizedWhole:
    """A bucket on the signal schedule's whole level as 8-bit codes: `flat`, its gradient (where
    the average lands); `source`, what is quantized (the residual after error feedback, else the
    gradient); `error`, where what the codes lose goes (the residual, or None); `gradient_energy`,
    this rank's, None where the schedule does not measure it (a small bucket); `ranges` of its
    chunks, all-reduced with max, and `levels`, each rank's codes; `why` it is whole."""

    flat: torch.Tensor
    source: torch.Tensor
    error: Optional[torch.Tensor]
    gradient_energy: Optional[torch.Tensor]
    ranges: torch.Tensor
    levels: int
    why: str
    density: float = 1.0


@dataclass
class Level:
    """The signal schedule's state of one bucket slot: `level`, its place on the ladder
    (TopKState.ladder(): 0 is whole); `steps` there; `signal`, the smoothed density * residual
    energy / gradient energy; `energy`, the smoothed gradient energy, and `history`, its last
    WINDOW + 1 values; `calm`, the steps since it last changed by more than critical_change over
    WINDOW steps; `sparse`, whether it has left the whole level (without return_whole it then
    goes no denser than level 1); `measured`, the last exchange's summed (residual, gradient) energies and the density
    they were measured at, once their all-reduce (`work`) is done."""

    level: int = 0
    steps: int = 0
    signal: Optional[float] = None
    energy: Optional[float] = None
    history: list = field(default_factory=list)
    calm: int = 0
    sparse: bool = False
    measured: Optional[tuple] = None  # (wait, energies, density): wait() until they are here

    def saved(self) -> tuple:
        return (
            self.level,
            self.steps,
            self.signal,
            self.energy,
            list(self.history),
            self.calm,
            self.sparse,
        )


@dataclass(eq=False)
class TopKState(ReportsBuckets, Compressor):
    """Configuration, per-bucket memory and the Compressor of topk_hook (and of a
    GradientAverager given it as `compression`).

    ratio: the sparsest density a bucket goes to: fraction of its entries sent.
    dense_steps: first iterations averaged densely, as float32. Residuals and velocities are kept
    per bucket and follow their parameters when DDP rebuilds its buckets after the first
    iteration.
    schedule: how dense a bucket goes after that. "signal" (default): by the run's own signal,
    the same on every rank. The levels: whole (every element, as 8-bit codes or value_dtype, see
    quantize_whole; what that loses kept by error feedback), then warmup_density, / 4 at each
    level (6.25%, 1.56%, 0.39%, ...)
    down to ratio. After each step the ranks sum their gradient energy G and residual energy R
    (what error feedback keeps back). Critical: G, smoothed, changed by more than
    critical_change (relative) over the last WINDOW steps, as it does while training finds its
    way (Accordion's critical regime: there compression costs accuracy that later steps do not
    win back). Held back: density * R / G, smoothed, above residual_limit; about 1/6 at any
    density where what waits in the residual is noise that averages out, growing as 1 / density
    where it is gradient held back step after step. A bucket starts whole; after MIN_STEPS steps
    at a level it goes a level denser while critical or held back, and a level sparser once it
    has spent 1 / density steps there (the steps error feedback takes to settle), nothing was
    critical for WINDOW steps and nothing is held back. "fixed": Deep Gradient Compression's
    warm-up schedule: warmup_density, divided by 4 at each of the stages that share
    warmup_steps equally, then ratio (warmup_steps 0: ratio from the start).
    critical_change, residual_limit: the signal schedule's thresholds (above).
    whole_share: with the signal schedule, the smallest buckets of the last step, together at
    most this share of its elements, stay whole from the step after (every step once the
    buckets are known): they cost that share of a whole step at most, while their top-k would
    save little and can cost accuracy (docs/performance.md: the digits MLP's first layer, 3% of
    its parameters). 0: none.
    quantize_whole: the whole level travels as 8-bit codes, QuantizeState's scheme (an agreed
    scale per chunk of compress.QUANTIZE_CHUNK elements, nearest rounding; two all-reduces, one
    byte an element: half value_dtype's bytes at 16 bits). False, or over more than 17 ranks
    (fewer than MIN_WHOLE_LEVELS code values a rank): as value_dtype.
    return_whole: whether a bucket that has gone sparse goes whole again in a later critical
    spell. False keeps whole to the start's critical regime (warmup_density at the densest
    after): on 4 hosts, half the bytes and 1.24x faster steps on the classification MLP of
    docs/performance.md at 200 steps, and with warmup_density=1/32 too 2.09-2.28x bf16's speed at
    200 steps and more; but 1.6-2.2 points from dense (medians) on that MLP at 64 examples a step
    (2 ranks of 32, 4 of 16), where the later whole spells keep it within about a point.
    warmup_density: the densest a top-k goes (both schedules).
    error_feedback: keep unsent entries (and value rounding) for later steps.
    adaptive: a bucket goes whole when the cost model puts its dense all-reduce at no more than
    its sparse exchange (small buckets, where dense takes fewer rounds, and high densities); the
    model is the communicator's where RINGCOMM_TUNING pins it, else the fixed one, so the choice
    follows the sizes alone (compress.sparse_choice). False: every floating bucket is compressed.
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
    schedule: str = "signal"
    critical_change: float = 0.4
    residual_limit: float = 1.0
    return_whole: bool = True
    whole_share: float = 0.05
    quantize_whole: bool = True
    stats: TopKStats = field(default_factory=TopKStats, kw_only=True)
    levels: dict = field(default_factory=dict, repr=False, kw_only=True)  # slot -> Level
    _lane: Optional[Lane] = field(default_factory=lambda: Lane("top-k"), repr=False, kw_only=True)
    # Each bucket slot's elements in the last step, and so far in this one (whole_share).
    step_numels: dict = field(default_factory=dict, repr=False, kw_only=True)
    _numels_this_step: dict = field(default_factory=dict, repr=False, kw_only=True)
    _small: frozenset = field(default=frozenset(), repr=False, kw_only=True)

    SETTINGS = (
        "ratio",
        "dense_steps",
        "warmup_steps",
        "warmup_density",
        "error_feedback",
        "adaptive",
        "value_dtype",
        "momentum_correction",
        "momentum",
        "clip_norm",
        "schedule",
        "critical_change",
        "residual_limit",
        "return_whole",
        "whole_share",
        "quantize_whole",
    )

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if not 0 < self.warmup_density <= 1:
            raise ValueError(f"warmup_density must be in (0, 1], got {self.warmup_density}")
        if self.value_dtype not in compress.TOPK_DTYPES:
            raise TypeError(
                f"value_dtype must be one of {compress.TOPK_DTYPES}, got {self.value_dtype}"
            )
        if self.dense_steps < 0 or self.warmup_steps < 0:
            raise ValueError("dense_steps and warmup_steps must be >= 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {self.clip_norm}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 <= self.whole_share <= 1:
            raise ValueError(f"whole_share must be in [0, 1], got {self.whole_share}")
        if not self.residual_limit > 0 or not self.critical_change > 0:
            raise ValueError(
                f"residual_limit and critical_change must be positive, got "
                f"{self.residual_limit} and {self.critical_change}"
            )

    @property
    def residuals(self) -> dict:
        """Error feedback's residual per bucket slot."""
        return self.memory.named("residuals")

    @property
    def velocities(self) -> dict:
        """Momentum correction's velocity per bucket slot."""
        return self.memory.named("velocities")

    def ladder(self) -> list:
        """The densities of the signal schedule, densest first: 1.0 (whole), warmup_density /
        4**i above ratio, then ratio."""
        if self.warmup_density <= self.ratio:
            return [1.0, self.ratio]
        out = [1.0, self.warmup_density]
        while out[-1] / 4 > self.ratio:
            out.append(out[-1] / 4)
        return out + [self.ratio]

    def density(self, step: Optional[int] = None) -> float:
        """The fixed schedule's fraction of entries sent at `step` (default: the current step);
        1 for dense steps."""
        step = self.step if step is None else step
        if step < self.dense_steps:
            return 1.0
        stages = 0  # densities warmup_density / 4**i above ratio
        while self.warmup_density / 4**stages > self.ratio:
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
            raise ValueError(
                f"take_momentum needs one momentum in (0, 1) shared by every "
                f"parameter group, got {sorted(momenta)}"
            )
        for g in groups:
            if g.get("dampening", 0) or g.get("nesterov", False) or g.get("weight_decay", 0):
                raise ValueError(
                    "take_momentum supports SGD momentum without dampening, Nesterov "
                    "or weight decay"
                )
        self.momentum = next(iter(momenta))
        self.momentum_correction = True
        for g in groups:
            g["momentum"] = 0

    def state_dict(self) -> dict:
        """Everything needed to resume (no communicator inside)."""
        state = {key: getattr(self, key) for key in self.SETTINGS}
        state.update(
            step=self.step,
            step_numels=dict(self.step_numels),
            residuals={i: t.clone() for i, t in self.residuals.items()},
            velocities={i: t.clone() for i, t in self.velocities.items()},
            levels={i: lv.saved() for i, lv in self.levels.items()},
        )
        return state

    def load_state_dict(self, state: dict):
        for key in self.SETTINGS + ("step",):
            if key in state:
                setattr(self, key, state[key])
        self.step_numels = {int(i): n for i, n in state.get("step_numels", {}).items()}
        self._numels_this_step = {}
        self._small = self._small_slots()
        self.memory.load_state_dict(
            {"residuals": state["residuals"], "velocities": state["velocities"]}
        )
        self.levels = {int(i): Level(*lv) for i, lv in state.get("levels", {}).items()}
        self.__post_init__()

    # -- the signal schedule -------------------------------------------------------------------

    def _level_density(self, slot: int) -> float:
        """Moves the slot's level by what its last exchange measured; returns its density."""
        ladder = self.ladder()
        lv = self.levels.get(slot)
        if lv is None:
            lv = self.levels[slot] = Level()
            return ladder[0]
        lv.level = min(lv.level, len(ladder) - 1)  # a resumed state may have another ratio
        lv.steps += 1
        if lv.measured is not None:
            wait, energies, density = lv.measured
            lv.measured = None
            wait()  # long done: all-reduced right after the bucket's exchange
            residual, gradient = energies.tolist()
            if gradient > 0:
                lv.energy = (
                    gradient
                    if lv.energy is None
                    else lv.energy + ENERGY_SMOOTHING * (gradient - lv.energy)
                )
                lv.history = (lv.history + [lv.energy])[-(WINDOW + 1) :]
                critical = abs(lv.energy / lv.history[0] - 1) > self.critical_change
                lv.calm = 0 if critical else lv.calm + 1
                q = density * residual / gradient
                lv.signal = q if lv.signal is None else lv.signal + SMOOTHING * (q - lv.signal)
        if lv.signal is not None and lv.steps >= MIN_STEPS:
            if (lv.calm == 0 or lv.signal > self.residual_limit) and lv.level > 0:
                # without return_whole, once sparse, level 1 at the densest: it starts over there
                densest = int(lv.sparse and not self.return_whole)
                lv.level, lv.steps, lv.signal = max(lv.level - 1, densest), 0, None
            elif (
                lv.calm >= WINDOW
                and lv.signal <= self.residual_limit
                and lv.level + 1 < len(ladder)
                and lv.steps >= math.ceil(1 / ladder[lv.level])
            ):
                lv.level, lv.steps, lv.signal = lv.level + 1, 0, None
                lv.sparse = True
        return ladder[lv.level]

    # -- the Compressor: the bucket's top-k with error feedback, or the bucket whole -------------

    def compress(self, comm, bucket: Bucket):
        """Whole as float32 on dense steps, for other dtypes and where the cost model prefers it;
        whole as 8-bit codes or value_dtype on the signal schedule's whole level; else the top-k
        of the bucket's flat gradient. Both of the last two with error feedback, whose residual
        and velocity memory is the bucket's slot."""
        slot, flat = bucket.slot, bucket.gradient()
        numel = flat.numel()
        source = flat
        if flat.dtype not in compress.TOPK_DTYPES:
            reason = f"{flat.dtype} is not compressed"
        elif self.step < self.dense_steps:
            reason = "dense steps"
        else:
            reason = None
        self._numels_this_step[slot] = numel
        whole, why, density, choice = False, None, 1.0, None
        if reason is None:
            # the slot's size checked too: DDP rebuilds its buckets after the first step
            small = slot in self._small and self.step_numels.get(slot) == numel
            if self.schedule == "signal" and small:
                whole, why = True, "a small bucket"
                self.levels.pop(slot, None)
            elif self.schedule == "signal":
                density = self._level_density(slot)
                whole, why = self.levels[slot].level == 0, "critical regime"
            else:
                density = self.density()
        if reason is None and not whole:
            k = max(1, int(numel * density))
            choice = compress.sparse_choice(comm, numel, k, self.value_dtype, flat.dtype)
            if self.adaptive and not choice.sparse:
                reason = "its dense all-reduce costs no more"
        self.stats.densities[slot] = 1.0 if reason else density
        if self.clip_norm is not None:
            limit = self.clip_norm / comm.world_size**0.5
            norm = float(torch.linalg.vector_norm(source))
            if norm > limit:
                source = source * (limit / norm)
        if self.momentum_correction and flat.is_floating_point():
            velocity = self.memory.get("velocities", bucket, source)
            velocity.mul_(self.momentum).add_(source)
            source = velocity
        if reason is not None:
            residual = self.memory.pop("residuals", slot) if self.error_feedback else None
            if residual is not None and residual.shape == source.shape:
                source = source + residual  # owed: out now
            elif source is not flat:
                source = source.clone()  # the velocity is kept; the all-reduce works in place
            return Dense(source, reason)
        residual = self.memory.get("residuals", bucket, source) if self.error_feedback else None
        measured = why == "critical regime"  # the schedule's level reads the energies
        levels = compress.CODE_SUM // comm.world_size
        if whole and self.quantize_whole and levels >= MIN_WHOLE_LEVELS:
            with trace.span("compress", numel=numel):
                # residual += source, then the chunks' ranges of what is owed
                ranges = compress.quantize_ranges(source, residual, compress.QUANTIZE_CHUNK)
            owed = source if residual is None else residual
            # the gradient's energy here, on the caller's stream, while `source` is alive
            energy = _energy(source) if measured else None
            return _QuantizedWhole(flat, owed, residual, energy, ranges, levels, why)
        if whole:
            if residual is None:
                wire = source.to(self.value_dtype, copy=True)
            else:
                residual.add_(source)
                wire = residual.to(self.value_dtype, copy=True)
                residual.sub_(wire.to(residual.dtype))  # what the rounding lost: owed
            energies = self._energies(residual, _energy(source)) if measured else None
            return _Whole(flat, wire, energies, why)
        with trace.span("compress", numel=numel, k=k):
            if residual is not None:
                # what rounding to the wire type loses is owed too: the kernel keeps it
                wire_values, indices = compress.topk_with_residual(
                    source, residual, k, self.value_dtype
                )
            else:
                values, indices = compress.topk(source, k)
                wire_values = values.to(self.value_dtype)
            energies = (
                self._energies(residual, _energy(source)) if self.schedule == "signal" else None
            )
        if self.momentum_correction:
            source.index_fill_(0, indices.long(), 0)  # DGC's momentum factor masking
        return _Sparse(flat, indices, wire_values, choice.algorithm, density, energies)

    @staticmethod
    def _energies(residual: Optional[torch.Tensor], gradient_energy: torch.Tensor) -> torch.Tensor:
        """This rank's (residual, gradient) energies, float64 on the gradient's device, to sum
        over ranks."""
        kept = torch.zeros_like(gradient_energy) if residual is None else _energy(residual)
        return torch.stack([kept, gradient_energy])

    def dense_reason(self, compressed) -> Optional[str]:
        if isinstance(compressed, _QuantizedWhole):
            return f"whole as 8-bit codes: {compressed.why}"
        if isinstance(compressed, _Whole):
            wire = str(self.value_dtype).replace("torch.", "")
            return f"whole as {wire}: {compressed.why}"
        return super().dense_reason(compressed)

    def exchange(self, comm, bucket: Bucket, compressed) -> torch.futures.Future:
        """In the lane's order (a bucket of 8-bit codes issues its codes from the completion of
        its ranges): the sparse all-reduce of the top-k, the all-reduce of the whole bucket
        (averages), or the ranges all-reduced with max and then the codes with sum; then, for the
        signal schedule, the sum of the ranks' energies, added in a fixed order so that every
        rank decides alike."""
        flat = compressed.flat

        def counted(work):
            if bucket.index is not None:
                comm.bucket_stats.add_work(bucket.index, work)
            return work

        if isinstance(compressed, _QuantizedWhole):
            q = compressed

            def agree(_):
                return counted(comm.all_reduce(q.ranges, op="max", async_op=True))

            def send(ranges):
                measured = q.gradient_energy is not None
                for t in (q.ranges, q.source) + ((q.gradient_energy,) if measured else ()):
                    compress.held_here(t)
                with trace.span("quantize", numel=q.source.numel()):
                    codes = compress.quantize(
                        q.source, ranges, compress.QUANTIZE_CHUNK, q.levels, error=q.error
                    )
                    if measured:
                        energies = self._energies(q.error, q.gradient_energy)
                work = counted(comm.all_reduce(codes, op="sum", async_op=True))
                if measured:
                    self._sum_energies(comm, bucket, energies, q.density)
                return work

            return compress.rounds(comm, self._lane, [agree, send], bucket.device)

        def send(_):
            if isinstance(compressed, _Whole):
                work = compress.average_densely(comm, compressed.wire)
            else:
                # The gradient is consumed: the average can take its place (no
                # 4-bytes-per-element allocation, and its page faults, per step).
                work = comm.sparse_all_reduce(
                    compressed.indices,
                    compressed.values,
                    flat.numel(),
                    out=flat,
                    op="avg",
                    algorithm=compressed.algorithm,
                    async_op=True,
                )
            counted(work)
            if compressed.energies is not None:
                self._sum_energies(comm, bucket, compressed.energies, compressed.density)
            return work

        return compress.rounds(comm, self._lane, [send], bucket.device)

    def _sum_energies(self, comm, bucket: Bucket, energies: torch.Tensor, density: float) -> None:
        """Starts the sum of the ranks' (residual, gradient) energies, which the slot's level
        reads at its next step."""
        if not energies.is_cuda:
            summed = comm.all_reduce(
                energies, op="sum", algorithm="recursive_doubling", async_op=True
            )
            wait = summed.wait
        else:
            # The sum comes to the host from its completion (this may run on the progress
            # thread, where a blocking all-reduce cannot wait), behind it on the stream, so that
            # reading it at the next step does not wait for the work queued on the stream since.
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            copied = torch.cuda.Event()

            def to_host(fut):
                host.copy_(fut.value(), non_blocking=True)
                copied.record(torch.cuda.current_stream(host_device))

            host_device = energies.device
            nbytes = energies.numel() * energies.element_size()
            algorithm = compress.all_reduce_algorithm(comm, nbytes, host_device)
            work = comm.all_reduce(energies, op="sum", algorithm=algorithm, async_op=True)
            done = work.get_future().then(to_host)

            def wait():
                done.wait()
                copied.synchronize()

            energies = host
        self.levels[bucket.slot].measured = (wait, energies, density)

    def decompress(self, comm, bucket: Bucket, compressed, exchanged: torch.Tensor) -> torch.Tensor:
        """The average comes back whole and flat, into the gradient: shaped like bucket.flat,
        where given."""
        if isinstance(compressed, _QuantizedWhole):
            compress.held_here(compressed.ranges)
            exchanged = compress.dequantize_mean(
                exchanged,
                compressed.ranges,
                compress.QUANTIZE_CHUNK,
                compressed.levels,
                comm.world_size,
                out=compressed.flat,
            )
        elif isinstance(compressed, _Whole):
            exchanged = compressed.flat.copy_(exchanged)
        return exchanged if bucket.flat is None else exchanged.view_as(bucket.flat)

    def end_step(self, comm) -> None:
        self.step_numels, self._numels_this_step = self._numels_this_step, {}
        self._small = self._small_slots()
        super().end_step(comm)

    def _small_slots(self) -> frozenset:
        """The slots whole_share keeps whole: the last step's smallest buckets (ties by slot, so
        every rank picks alike) while together at most whole_share of its elements."""
        budget = self.whole_share * sum(self.step_numels.values())
        small, used = set(), 0
        for numel, slot in sorted((n, s) for s, n in self.step_numels.items()):
            if used + numel > budget:
                break
            small.add(slot)
            used += numel
        return frozenset(small)

    def started(self, comm, bucket: Bucket, compressed) -> None:
        """On the last dense step, zeroed memory for the first compressed step's residuals."""
        if (
            self.error_feedback
            and self.step + 1 == self.dense_steps
            and bucket.dtype in compress.TOPK_DTYPES
        ):
            self.memory.prepare(compressed.tensor)


def _energy(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of `t`, as float64. The norm itself is taken in float32 (half types
    cast up, against overflow), not in float64, whose cast of every element makes the CPU's pass
    over a bucket an order of magnitude slower; the schedule's thresholds need no more digits."""
    dtype = torch.float32 if t.element_size() < 4 else None
    return torch.linalg.vector_norm(t, dtype=dtype).double().square()


@ringcomm_named
def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: top-k sparse exchange with error feedback (see TopKState for how dense each
    bucket goes)."""
    if not isinstance(state, TopKState):
        raise TypeError(f"topk_hook needs a ringcomm.hooks.TopKState, got {type(state).__name__}")
    return run_compressor(state, bucket)
