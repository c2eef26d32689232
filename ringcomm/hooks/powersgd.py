"""PowerSGD (Vogels et al., 2019): low-rank gradient compression with error feedback, as a DDP
communication hook.

    state = ringcomm.hooks.PowerSGDState(matrix_approximation_rank=2, start_iter=10)
    ddp.register_comm_hook(state, ringcomm.hooks.powersgd_hook)

The gradient of a parameter with two or more dimensions is viewed as an n x m matrix M (shape[0]
rows; a conv kernel's other dimensions make the columns) and travels as two thin factors. With r
the rank and Q an m x r matrix kept from the previous step (warm start) or drawn from `seed`:

    M += error; orthonormalize Q; P = M Q; all-reduce(P, avg); orthonormalize P (QR);
    Q = M^T P; all-reduce(Q, avg); M' = P Q^T; error = M - M'; gradient = M'

so (n + m) r values are sent instead of n m. P is the same on every rank after its all-reduce,
and so is its orthonormalization; so is the averaged Q, the next step's start. Vectors, and
matrices too small to be worth it (min_compression_rate), are averaged whole, packed into the
same message as the bucket's P factors: two all-reduces per bucket, [whole | P], then [Q].

Order. The Q all-reduce can only start once P's has finished, so it is issued from P's completion
callback, on the communicator's progress thread, while backward goes on issuing the next buckets
from the main thread. Ranks whose threads interleave differently would issue their collectives in
different orders (torch's powerSGD_hook on gloo fails this way). Here a bucket issues its first
all-reduce only after the bucket before it has issued its last (compress.Lane, compress.rounds),
so every rank issues the same messages in the same order whatever the timing. Nothing here waits
on a ringcomm Work inside a callback (that would block the very thread that completes it): each
step is a callback of the one before, and the last completes the Future the hook returned. An
error (a failed all-reduce, or an exception in this code) fails that Future, so it comes out of
DDP's backward; an exception raised here also aborts the communicator, so the other ranks'
operations fail at once instead of waiting for a message this rank will not send. The all-reduces
take an algorithm chosen by size (compress.all_reduce_algorithm), so the bits of the average do
not depend on the load at start either.

CUDA gradients stay on their device: the factors, the error memory and the scratch are made
there, and the products and QR run there with torch's CUDA ops; the all-reduces take the
communicator's device path (staged through host memory only where no device transport serves
every rank, ringcomm/staging.py). Each step is enqueued on a stream that waits for the one before
(P's preparation, then each all-reduce's CUDA-aware future), and the Future returned is
CUDA-aware: its waiters' streams wait for M'. The host waits for none of it; on the device path a
collective's Work completes for the host once enqueued, so a bucket's rounds are all enqueued
before the hook returns. Only the random starting Q (drawn from `seed`, no gradient data) crosses
from the host.

This module must not use `from __future__ import annotations` (see default.py: DDP compares the
hook's annotations as objects).
"""

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

import torch.distributed as dist

from .. import compress
from ..compress import Bucket, CompressionStats, Compressor, Lane, abort_on
from .compressor import run_compressor
from .state import ReportsBuckets, ringcomm_named

_COMPUTE_DTYPES = (torch.float32, torch.float64)  # float16 / bfloat16 gradients: math in float32


@dataclass
class PowerSGDStats(CompressionStats):
    """Running totals since the state was created (load_state_dict leaves them as they are); a
    bucket counts as compressed where any of its matrices travels as factors."""

    compressed_tensors: int = 0  # gradients sent as P and Q factors (counted every step)
    dense_tensors: int = 0  # gradients sent whole (warm-up steps included)
    # error feedback, P, Q, orthonormalization, M' on this rank (CUDA gradients: enqueuing them)
    compute_seconds: float = 0.0


@dataclass(frozen=True)
class _Plan:
    """How one bucket's gradients travel: a function of their shapes and the configuration only,
    so the same on every rank. dense: indices of the tensors sent whole; matrices: (index, n, m, r)
    of those sent as factors."""

    dense: tuple
    matrices: tuple
    dense_numel: int
    p_numel: int
    q_numel: int
    m_numel: int  # elements of the compressed matrices (the error memory)


@functools.lru_cache(maxsize=4096)
def _plan(shapes: tuple, rank: int, min_compression_rate: float, compressing: bool) -> _Plan:
    dense, matrices, dense_numel = [], [], 0
    for i, shape in enumerate(shapes):
        numel = functools.reduce(lambda a, b: a * b, shape, 1)
        if compressing and len(shape) >= 2 and numel > 0:
            n, m = shape[0], numel // shape[0]
            r = min(n, m, rank)
            if (n + m) * r * min_compression_rate < n * m:
                matrices.append((i, n, m, r))
                continue
        dense.append(i)
        dense_numel += numel
    return _Plan(
        tuple(dense),
        tuple(matrices),
        dense_numel,
        sum(n * r for _, n, _, r in matrices),
        sum(m * r for _, _, m, r in matrices),
        sum(n * m for _, n, m, _ in matrices),
    )


@dataclass
class _Memory:
    """What one bucket (or, under compiled DDP, one parameter) keeps between steps."""

    signature: tuple  # (dtype, shapes, rank, min_compression_rate)
    error: Optional[torch.Tensor]  # the compressed matrices' errors, flat, in compute dtype
    q: Optional[torch.Tensor]  # the last averaged Q factors, flat (warm start)


@dataclass(eq=False)
class PowerSGDState(ReportsBuckets, Compressor):
    """Configuration, per-bucket memory and the Compressor of powersgd_hook (and of a
    GradientAverager given it as `compression`): one state per model.

    matrix_approximation_rank: r, the columns of the P and Q factors (clipped to min(n, m)). 2 by
    default (torch's hook and the authors' example use 1): twice rank 1's bytes, still a small
    fraction of the dense ones, for an approximation that captures two directions of each
    gradient instead of one.
    start_iter: iterations averaged densely first. DDP rebuilds its buckets after its first
    iteration, so with DDP and error feedback or warm start it must be at least 2.
    min_compression_rate: a matrix is compressed only if n m > min_compression_rate (n + m) r;
    others, and every tensor with fewer than 2 dimensions, are averaged whole.
    error_feedback: add what the approximation missed to the next step's gradient.
    warm_start: start each step's power iteration from the last averaged Q (else a new random Q
    every step).
    seed: seeds the random starting Q, the same on every rank.
    comm: a ringcomm Communicator or ringcomm process group (None: created from the default
    process group's store on first use, see state.communicator_for). Issue nothing else on it
    while a step's gradients are being averaged (DDP: during backward; GradientAverager: until
    step() returns): PowerSGD issues its Q all-reduces from the progress thread, and another
    collective issued meanwhile would be ordered differently on different ranks. So with DDP over
    a ringcomm group and find_unused_parameters=True (DDP all-reduces its used-parameter map
    during backward), leave comm None rather than passing DDP's own group.
    """

    matrix_approximation_rank: int = 2
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    stats: PowerSGDStats = field(default_factory=PowerSGDStats, kw_only=True)
    factors: dict = field(default_factory=dict, kw_only=True)  # slot -> _Memory
    _lane: Lane = field(default_factory=lambda: Lane("PowerSGD"), repr=False, kw_only=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, kw_only=True)

    _CONFIG = (
        "matrix_approximation_rank",
        "start_iter",
        "min_compression_rate",
        "error_feedback",
        "warm_start",
        "seed",
    )

    def __post_init__(self):
        if int(self.matrix_approximation_rank) < 1:
            raise ValueError(
                f"matrix_approximation_rank must be >= 1, got {self.matrix_approximation_rank}"
            )
        if int(self.start_iter) < 0:
            raise ValueError(f"start_iter must be >= 0, got {self.start_iter}")
        if self.min_compression_rate < 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {self.min_compression_rate}")

    def end_step(self, comm):
        with self._lock:
            super().end_step(comm)

    def _add_stats(self, **amounts):
        with self._lock:
            for key, value in amounts.items():
                setattr(self.stats, key, getattr(self.stats, key) + value)

    def _memory_for(self, slot: int, signature: tuple, plan: _Plan, dtype, device) -> _Memory:
        """The slot's memory on the gradients' device, made anew when its gradients changed (DDP
        rebuilt its buckets) or the configuration did; moved there when loaded from another."""
        mem = self.factors.get(slot)
        if mem is None or mem.signature != signature:
            mem = self.factors[slot] = _Memory(signature, None, None)
        if not self.error_feedback:
            mem.error = None
        elif mem.error is None:
            mem.error = torch.zeros(plan.m_numel, dtype=dtype, device=device)
        else:
            mem.error = mem.error.to(device)
        if mem.q is not None:
            mem.q = mem.q.to(device)
        return mem

    def state_dict(self) -> dict:
        """Everything needed to resume: configuration, step, and per slot the error and Q
        memories (no communicator inside)."""
        out = {key: getattr(self, key) for key in self._CONFIG}
        out["step"] = self.step
        out["memory"] = {
            slot: {
                "signature": mem.signature,
                "error": None if mem.error is None else mem.error.clone(),
                "q": None if mem.q is None else mem.q.clone(),
            }
            for slot, mem in self.factors.items()
        }
        return out

    def load_state_dict(self, state: dict):
        for key in self._CONFIG + ("step",):
            setattr(self, key, state[key])
        self.factors = {
            int(slot): _Memory(
                _as_tuple(mem["signature"]),
                None if mem["error"] is None else mem["error"].clone(),
                None if mem["q"] is None else mem["q"].clone(),
            )
            for slot, mem in state["memory"].items()
        }
        self._step_start_bytes = None
        self._param_slots = {}
        self._lane = Lane("PowerSGD")
        self.__post_init__()

    # -- the Compressor: see the module's docstring for the steps and their order ---------------

    def compress(self, comm, bucket: Bucket) -> "_Exchange":
        """Error feedback, the starting Q and the P factors, packed after the tensors sent whole.
        A failure aborts the communicator: the other ranks wait for this bucket's messages."""
        try:
            return _Exchange(self, comm, bucket)
        except BaseException as e:
            abort_on(comm, e, "PowerSGD")
            raise

    def exchange(self, comm, bucket: Bucket, compressed: "_Exchange") -> torch.futures.Future:
        """Once the bucket before it has issued its last message: [whole tensors | P] averaged,
        then the Q factors, from P's completion (on the progress thread; on the device path, at
        once)."""
        rounds = [compressed.send_p] + ([compressed.send_q] if compressed.plan.matrices else [])
        return compress.rounds(comm, self._lane, rounds, compressed.device)

    def decompress(
        self, comm, bucket: Bucket, compressed: "_Exchange", exchanged
    ) -> Optional[torch.Tensor]:
        """The average is in the gradients: bucket.flat (None without one) holds it."""
        try:
            compressed.finish()
        except BaseException as e:
            abort_on(comm, e, "PowerSGD")
            raise
        return bucket.flat

    def dense_reason(self, compressed: "_Exchange") -> Optional[str]:
        if compressed.plan.matrices:
            return None
        return "dense steps" if self.step < self.start_iter else "no matrix worth compressing"

    def average(self, comm, bucket: Bucket) -> torch.futures.Future:
        """Compressor.average, failing the Future where compress() fails (a KeyboardInterrupt
        is raised, as it would be without the hook), as where the exchange does."""
        try:
            return super().average(comm, bucket)
        except Exception as e:
            failed = torch.futures.Future()
            failed.set_exception(e)
            return failed


def _as_tuple(value):
    """Signatures come back from some serializers with lists for tuples."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _seed_for(seed: int, slot: int, step: int) -> int:
    return ((int(seed) * 1_000_003 + int(slot)) * 1_000_033 + int(step)) % (1 << 63)


def _orthonormalize(matrix: torch.Tensor):
    """Replaces the columns of `matrix` (k x r, r <= k) in place by orthonormal ones spanning the
    same space: Householder QR, whose factor is orthonormal whatever the input. Where columns are
    zero or dependent (a dead unit's zero row, a rank-deficient gradient, a zero gradient) it
    completes the basis with other directions, so M' = P P^T M stays a projection of M and a warm
    start never loses a column. Gram-Schmidt would divide by a norm that is zero or rounding noise
    there: NaN, or columns that are not orthogonal, or (with an epsilon added to the norm, as
    torch's hook does) a zero column that a warm start then keeps for ever. Deterministic: the same
    input gives the same bits, and P (or Q) is the same on every rank."""
    q, _ = torch.linalg.qr(matrix)
    matrix.copy_(q)


class _Exchange:
    """One bucket's average, PowerSGDState's compressed bucket. Prepared on the calling thread;
    then send_p() all-reduces [whole tensors | P factors]; send_q() finishes P and all-reduces
    the Q factors; finish() writes the whole tensors and M' into the gradients."""

    def __init__(self, state, comm, bucket: Bucket):
        self.state, self.comm, self.grads, self.slot = state, comm, list(bucket.grads), bucket.slot
        self.index, self.device = bucket.index, bucket.device
        flat = bucket.flat
        started = time.perf_counter()
        dtype = self.grads[0].dtype if self.grads else torch.float32
        if any(g.dtype != dtype for g in self.grads):
            raise TypeError("PowerSGD needs the gradients of one bucket to share a dtype")
        self.wire = dtype
        self.compute = dtype if dtype in _COMPUTE_DTYPES else torch.float32
        # float16 sums can overflow where the mean does not: scale first and sum (allreduce_hook)
        self.scale = 1.0 / comm.world_size if dtype == torch.float16 else 1.0
        self.op = "sum" if dtype == torch.float16 else "avg"
        shapes = tuple(tuple(g.shape) for g in self.grads)
        compressing = state.step >= state.start_iter and dtype.is_floating_point
        self.plan = _plan(
            shapes,
            int(state.matrix_approximation_rank),
            float(state.min_compression_rate),
            compressing,
        )
        numel = sum(g.numel() for g in self.grads)
        state._add_stats(
            compressed_tensors=len(self.plan.matrices), dense_tensors=len(self.plan.dense)
        )
        if (
            not self.plan.matrices
            and flat is not None
            and flat.is_contiguous()
            and flat.numel() == numel
        ):
            self.w1 = flat  # all whole, and the bucket is already one tensor: in place
            self.in_place = True
            if self.scale != 1.0:
                flat.mul_(self.scale)
        else:
            self.in_place = False
            self._prepare(shapes, dtype)
        state._add_stats(compute_seconds=time.perf_counter() - started)

    def _prepare(self, shapes, dtype):
        """Error feedback, the starting Q and the P factors, packed after the whole tensors."""
        state, plan = self.state, self.plan
        self.w1 = torch.empty(plan.dense_numel + plan.p_numel, dtype=self.wire, device=self.device)
        offset = 0
        for i in plan.dense:
            g = self.grads[i]
            self.w1[offset : offset + g.numel()].view(g.shape).copy_(g)
            offset += g.numel()
        if self.scale != 1.0:
            self.w1[:offset].mul_(self.scale)
        if not plan.matrices:
            return
        signature = (
            str(dtype),
            shapes,
            int(state.matrix_approximation_rank),
            float(state.min_compression_rate),
        )
        self.mem = state._memory_for(self.slot, signature, plan, self.compute, self.device)
        self._held(self.mem.error, self.mem.q)
        if state.warm_start and self.mem.q is not None:
            q_flat = self.mem.q
        else:
            # drawn on the host whatever the device, the same start on every rank; into pinned
            # memory for a CUDA device, so that the copy does not wait for its stream
            gen = torch.Generator().manual_seed(_seed_for(state.seed, self.slot, state.step))
            q_flat = torch.randn(
                plan.q_numel,
                generator=gen,
                dtype=self.compute,
                pin_memory=self.device.type == "cuda",
            )
            q_flat = q_flat.to(self.device, non_blocking=True)
        self.ms, p_offset, q_offset, e_offset = [], offset, 0, 0
        for i, n, m, r in plan.matrices:
            g = self.grads[i]
            if g.dtype == self.compute and g.is_contiguous():
                matrix = g.view(n, m)  # error feedback goes into the gradient itself
            else:
                matrix = g.reshape(n, m).to(self.compute, copy=True)
            if self.mem.error is not None:
                matrix.add_(self.mem.error[e_offset : e_offset + n * m].view(n, m))
            q = q_flat[q_offset : q_offset + m * r].view(m, r)
            _orthonormalize(q)
            p = self.w1[p_offset : p_offset + n * r].view(n, r)
            if self.wire == self.compute:
                torch.mm(matrix, q, out=p)
            else:
                p.copy_(torch.mm(matrix, q).mul_(self.scale))
            self.ms.append(matrix)
            p_offset, q_offset, e_offset = p_offset + n * r, q_offset + m * r, e_offset + n * m

    # -- in the lane's order: these run on the progress thread (or inline, if already due) ----

    def send_p(self, _):
        return self._all_reduce(self.w1)

    def send_q(self, _):
        """Once P is averaged: the whole tensors into the gradients, P orthonormalized, and the
        Q factors all-reduced."""
        started = time.perf_counter()
        plan = self.plan
        self._held(self.w1, *self.ms)
        self._unpack_whole()
        self.w2 = torch.empty(plan.q_numel, dtype=self.wire, device=self.device)
        self.ps, p_offset, q_offset = [], plan.dense_numel, 0
        for (_, n, m, r), matrix in zip(plan.matrices, self.ms):
            p = self.w1[p_offset : p_offset + n * r].view(n, r)
            if self.wire != self.compute:
                p = p.to(self.compute)
            _orthonormalize(p)  # the same bits on every rank
            q = self.w2[q_offset : q_offset + m * r].view(m, r)
            if self.wire == self.compute:
                torch.mm(matrix.t(), p, out=q)
            else:
                q.copy_(torch.mm(matrix.t(), p).mul_(self.scale))
            self.ps.append(p)
            p_offset, q_offset = p_offset + n * r, q_offset + m * r
        self.state._add_stats(compute_seconds=time.perf_counter() - started)
        return self._all_reduce(self.w2)

    def _all_reduce(self, flat: torch.Tensor):
        algorithm = compress.all_reduce_algorithm(
            self.comm, flat.numel() * flat.element_size(), flat.device
        )
        work = self.comm.all_reduce(flat, op=self.op, algorithm=algorithm, async_op=True)
        if self.index is not None:
            self.comm.bucket_stats.add_work(self.index, work)
        return work

    def _held(self, *tensors):
        """On CUDA, where the steps run on different streams (the caller's, then each
        collective's callback's): `tensors` (None skipped), made or last used on another stream,
        stay allocated until the current one is past what is enqueued on them now."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for t in tensors:
                if t is not None:
                    t.record_stream(stream)

    def _unpack_whole(self):
        if not self.in_place:
            offset = 0
            for i in self.plan.dense:
                g = self.grads[i]
                g.copy_(self.w1[offset : offset + g.numel()].view(g.shape))
                offset += g.numel()

    # -- decompress: on the progress thread, once the last all-reduce has completed ------------

    def finish(self):
        """M' = P Q^T into the compressed gradients; the error memory and the warm start kept.
        Without matrices, the whole tensors into the gradients."""
        plan = self.plan
        self._held(self.w1)
        if not plan.matrices:
            self._unpack_whole()
            return
        started = time.perf_counter()
        mem = self.mem
        self._held(self.w2, mem.error, *self.ms, *self.ps)
        q_flat = self.w2 if self.wire == self.compute else self.w2.to(self.compute)
        q_offset, e_offset = 0, 0
        for (i, n, m, r), matrix, p in zip(plan.matrices, self.ms, self.ps):
            approx = torch.mm(p, q_flat[q_offset : q_offset + m * r].view(m, r).t())
            if mem.error is not None:
                torch.sub(matrix, approx, out=mem.error[e_offset : e_offset + n * m].view(n, m))
            g = self.grads[i]
            g.copy_(approx.view(g.shape))
            q_offset, e_offset = q_offset + m * r, e_offset + n * m
        mem.q = q_flat if self.state.warm_start else None
        self.state._add_stats(compute_seconds=time.perf_counter() - started)


@ringcomm_named
def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: PowerSGD low-rank compression with error feedback (dense during the first
    state.start_iter iterations). Under compiled DDP (a (grad, param) tuple per parameter) the
    average is written into grad before the hook returns."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"powersgd_hook needs a ringcomm.hooks.PowerSGDState, got {type(state).__name__}"
        )
    if (
        not isinstance(bucket, tuple)
        and state.start_iter < 2
        and (state.error_feedback or state.warm_start)
    ):
        raise ValueError(
            f"with DDP, PowerSGDState.start_iter must be >= 2 when error_feedback or "
            f"warm_start is on (got {state.start_iter}): DDP rebuilds its buckets "
            f"after its first iteration, and memory kept per bucket would then "
            f"belong to other parameters"
        )
    return run_compressor(state, bucket)
