"""Gradient compression: the interface every compression implements (Compressor, over a Bucket
of gradients), which GradientAverager and the DDP hooks drive, what it gets for free (memory that
follows its parameters, statistics, ordered rounds of collectives, choices that do not depend on
timing), and the kernels: top-k (exact, deterministic) and 8-bit quantization with an agreed
scale, CPU ones here and CUDA ones through ringcomm._C_cuda, same results.

    values, indices = ringcomm.compress.topk(t, k)
    values, indices = ringcomm.compress.topk_with_residual(grad, residual, k)
    ranges = ringcomm.compress.quantize_ranges(grad, residual, chunk)   # then all-reduce max
    codes = ringcomm.compress.quantize(residual, ranges, chunk, levels, error=residual)
    mean = ringcomm.compress.dequantize_mean(code_sums, ranges, chunk, levels, world)

Top-k selection is by magnitude; values keep their sign. Ties go to the lower index, NaN ranks
above inf (as in torch.topk). Indices are int32 in ascending order (not sorted by value).

A compressor in one file (the hook, GradientAverager, statistics and bench/compression_quality.py
take it as it is):

    class Bfloat16Feedback(ringcomm.compress.Compressor):    # half the bytes, nothing lost
        def compress(self, comm, bucket):
            residual = self.memory.get("residual", bucket, bucket.gradient())
            residual.add_(bucket.gradient())
            wire = residual.to(torch.bfloat16)
            residual.sub_(wire.float())                         # error feedback
            return wire
        def exchange(self, comm, bucket, wire):
            return ringcomm.compress.average_densely(comm, wire).get_future()
        def decompress(self, comm, bucket, wire, average):
            return average.float()

    ddp.register_comm_hook(Bfloat16Feedback(), ringcomm.hooks.compressor_hook)
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import _C, cuda
from ._buffers import TORCH_DTYPES
from ._env import env_int, env_string

TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZE_DTYPES = TOPK_DTYPES
# The most a uint8 sum of codes holds (kernels/quantize_math.h): each of n ranks' codes go up to
# CODE_SUM // n, so that their sum does.
CODE_SUM = 255
# Elements that share one scale in the hooks' 8-bit codes (QuantizeState's default chunk, and
# top-k's whole level): 8 bytes of ranges per 1,024 bytes of codes.
QUANTIZE_CHUNK = 1024

logger = logging.getLogger("ringcomm")


def _check(t: torch.Tensor, name: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in TOPK_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; top-k supports float32, float16, bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _outputs(t: torch.Tensor, k: int):
    k = int(k)
    if not 0 <= k <= t.numel():
        raise ValueError(f"k = {k} out of range [0, {t.numel()}]")
    return k, torch.empty(k, dtype=t.dtype), torch.empty(k, dtype=torch.int32)


def topk(t: torch.Tensor, k: int):
    """The k elements of `t` (flattened) with the largest magnitude: (values, int32 indices)."""
    if isinstance(t, torch.Tensor) and t.is_cuda:
        return cuda.topk(t, k)
    _check(t, "tensor")
    k, values, indices = _outputs(t, k)
    _C.topk_kernel(
        TORCH_DTYPES[t.dtype], t.data_ptr(), t.numel(), k, indices.data_ptr(), values.data_ptr()
    )
    return values, indices


def topk_with_residual(grad: torch.Tensor, residual: torch.Tensor, k: int, value_dtype=None):
    """Error-feedback step: acc = grad + residual; return the top-k of acc as (values, indices),
    the values as `value_dtype` (float32, float16 or bfloat16; default grad's dtype, rounded to
    nearest even), and leave acc in `residual` (updated in place) with each selected entry
    replaced by what rounding its value to value_dtype lost (zero when nothing was)."""
    if isinstance(grad, torch.Tensor) and grad.is_cuda:
        return cuda.topk_with_residual(grad, residual, k, value_dtype)
    _check(grad, "grad")
    _check(residual, "residual")
    if residual.dtype != grad.dtype or residual.numel() != grad.numel():
        raise ValueError(
            f"residual ({residual.dtype}, {residual.numel()} elements) must match "
            f"grad ({grad.dtype}, {grad.numel()} elements)"
        )
    value_dtype = grad.dtype if value_dtype is None else value_dtype
    if value_dtype not in TOPK_DTYPES:
        raise TypeError(f"value_dtype must be one of {TOPK_DTYPES}, got {value_dtype}")
    k, _, indices = _outputs(grad, k)
    values = torch.empty(k, dtype=value_dtype)
    _C.topk_with_residual_kernel(
        TORCH_DTYPES[grad.dtype],
        grad.data_ptr(),
        residual.data_ptr(),
        grad.numel(),
        k,
        indices.data_ptr(),
        values.data_ptr(),
        TORCH_DTYPES[value_dtype],
    )
    return values, indices


# -- 8-bit quantization (kernels/quantize_math.h) ------------------------------------------------


def _check_quantized(t: torch.Tensor, name: str, device: torch.device, dtypes=QUANTIZE_DTYPES):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {dtypes}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _kernel(device: torch.device, name: str):
    """The kernel `name` for tensors on `device`, and the extra arguments it ends with (the
    CUDA stream)."""
    if device.type == "cuda":
        return getattr(cuda._kernels(), name), (cuda._stream(device),)
    if device.type != "cpu":
        raise ValueError(f"8-bit quantization runs on CPU and CUDA tensors, not {device}")
    return getattr(_C, f"{name}_kernel"), ()


def _on(device: torch.device):
    """The device made current for a CUDA kernel's launch."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def quantize_chunks(numel: int, chunk: int) -> int:
    """Chunks of `chunk` elements in `numel` (the last may be shorter): one scale each."""
    return _C.quantize_chunks(int(numel), int(chunk))


def _ranges_of(numel: int, chunk: int, ranges: torch.Tensor, device: torch.device):
    _check_quantized(ranges, "ranges", device, (torch.float32,))
    if ranges.numel() != 2 * quantize_chunks(numel, chunk):
        raise ValueError(
            f"ranges has {ranges.numel()} elements; {numel} elements in chunks of "
            f"{chunk} need {2 * quantize_chunks(numel, chunk)}"
        )


def quantize_ranges(
    grad: torch.Tensor, residual: Optional[torch.Tensor], chunk: int
) -> torch.Tensor:
    """Error feedback and the ranges to agree on: with a residual, residual += grad (in place, in
    float, stored in their dtype); then per chunk of `chunk` elements of the residual (of grad
    without one), (-min, max) as float32, zeros made +0. All-reduced with op "max", they give
    every rank the same scale."""
    device = grad.device
    _check_quantized(grad, "grad", device)
    if residual is not None:
        _check_quantized(residual, "residual", device, (grad.dtype,))
        if residual.numel() != grad.numel():
            raise ValueError(f"residual has {residual.numel()} elements, grad {grad.numel()}")
    ranges = torch.empty(
        2 * quantize_chunks(grad.numel(), chunk), dtype=torch.float32, device=device
    )
    kernel, stream = _kernel(device, "quantize_ranges")
    with _on(device):
        kernel(
            TORCH_DTYPES[grad.dtype],
            grad.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            grad.numel(),
            int(chunk),
            ranges.data_ptr(),
            *stream,
        )
    return ranges


def quantize(
    source: torch.Tensor,
    ranges: torch.Tensor,
    chunk: int,
    levels: int,
    error: Optional[torch.Tensor] = None,
    key: Optional[int] = None,
) -> torch.Tensor:
    """uint8 codes of `source` under the agreed `ranges` (quantize_ranges, all-reduced with max),
    `levels` steps per chunk (1 .. 255): floor((x - lo) / step + 1/2), or with `key` (an int, the
    random stream) stochastic rounding, floor((x - lo) / step + u) with u uniform in [0, 1) drawn
    from (key, index) alone. `error` (source itself, or a tensor like it), when given, gets what
    each code lost: source - (lo + code step)."""
    device = source.device
    _check_quantized(source, "source", device)
    _ranges_of(source.numel(), chunk, ranges, device)
    if error is not None:
        _check_quantized(error, "error", device, (source.dtype,))
        if error.numel() != source.numel():
            raise ValueError(f"error has {error.numel()} elements, source {source.numel()}")
    codes = torch.empty(source.numel(), dtype=torch.uint8, device=device)
    kernel, stream = _kernel(device, "quantize")
    with _on(device):
        kernel(
            TORCH_DTYPES[source.dtype],
            source.data_ptr(),
            0 if error is None else error.data_ptr(),
            source.numel(),
            int(chunk),
            ranges.data_ptr(),
            int(levels),
            key is not None,
            0 if key is None else int(key) % (1 << 64),
            codes.data_ptr(),
            *stream,
        )
    return codes


def dequantize_mean(
    sums: torch.Tensor,
    ranges: torch.Tensor,
    chunk: int,
    levels: int,
    world: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The mean of `world` ranks' quantized values whose codes summed to `sums` (uint8):
    lo + step (sum / world), into `out` (float32, float16 or bfloat16; default a new float32
    tensor), which is returned."""
    device = sums.device
    _check_quantized(sums, "sums", device, (torch.uint8,))
    _ranges_of(sums.numel(), chunk, ranges, device)
    if out is None:
        out = torch.empty(sums.numel(), dtype=torch.float32, device=device)
    _check_quantized(out, "out", device)
    if out.numel() != sums.numel():
        raise ValueError(f"out has {out.numel()} elements, sums {sums.numel()}")
    kernel, stream = _kernel(device, "dequantize_mean")
    with _on(device):
        kernel(
            sums.data_ptr(),
            sums.numel(),
            int(chunk),
            ranges.data_ptr(),
            int(levels),
            int(world),
            TORCH_DTYPES[out.dtype],
            out.data_ptr(),
            *stream,
        )
    return out


# -- choices that change results: sizes and an agreed, recorded model, never timing --------------


def model_is_pinned() -> bool:
    """Whether the communicators' own algorithm choices replay from run to run: their link model
    pinned by RINGCOMM_TUNING (a file, or off) and auto not retuning as it runs
    (RINGCOMM_RETUNE_CALLS unset or 0). Else they follow the probe and trials, which time the
    machine as it is at that moment, and a compression's choices take the fixed model instead."""
    return env_string("RINGCOMM_TUNING") != "" and not env_int("RINGCOMM_RETUNE_CALLS")


def all_reduce_algorithm(comm, nbytes: int, device: Optional[torch.device] = None) -> str:
    """The algorithm a compression all-reduces `nbytes` of floating values on `device` (default
    the CPU) with: "auto" where its choice replays (model_is_pinned(), or RINGCOMM_ALGO forces
    one), else the fixed model's choice for that size over the communicator's ranks and hosts.
    Algorithms add in different orders, so this is what keeps the bits of an average independent
    of the load at start. CUDA tensors on a device path take "auto": its choice follows the size
    alone (csrc/device/executor.cc), among its transport's algorithms, which are not the host's.
    CUDA tensors staged through the host (no device path) take the host's, as CPU tensors do.
    Asking joins the device's path where none is yet (DevicePaths.get, a collective): callers
    ask right before the all-reduce of a tensor on that device, which would join it there."""
    if device is not None and device.type == "cuda" and comm._device_paths.get(device) is not None:
        return "auto"
    if comm.world_size < 2 or model_is_pinned() or env_string("RINGCOMM_ALGO") != "auto":
        return "auto"
    return _C.fixed_all_reduce(comm._core, int(nbytes))


@dataclass(frozen=True)
class SparseChoice:
    """Whether a vector goes as its top k (sparse_all_reduce with `algorithm`) or whole
    (average_densely), and the costs that decided it, in seconds by the model used."""

    sparse: bool
    algorithm: str
    sparse_cost: float
    dense_cost: float


def sparse_choice(
    comm, numel: int, k: int, value_dtype=torch.float32, out_dtype=torch.float32
) -> SparseChoice:
    """Top k pairs or the whole vector, by the cost model every rank agrees on: the
    communicator's own where it replays (model_is_pinned()), else the fixed one, whose choice
    follows the sizes alone (docs/algorithms.md, "Compression")."""
    if model_is_pinned():
        sparse_cost, dense_cost = comm.compression_costs(numel, k, value_dtype, out_dtype)
        return SparseChoice(sparse_cost < dense_cost, "auto", sparse_cost, dense_cost)
    # The dense way of the sparse all-reduce adds in ring order, gather and ranges in rank order:
    # the way is fixed here, not left to the exchange's estimate by the probed model.
    sparse_cost, dense_cost, way = _C.fixed_compression_costs(
        comm._core, int(numel), int(k), TORCH_DTYPES[value_dtype], TORCH_DTYPES[out_dtype]
    )
    return SparseChoice(sparse_cost < dense_cost, way, sparse_cost, dense_cost)


def average_densely(comm, tensor: torch.Tensor, async_op: bool = True):
    """The average of `tensor` over the ranks, in place, with all_reduce_algorithm()'s algorithm:
    a Work with async_op, else done on return. float16 is divided first and summed (its partial
    sums could overflow where the mean does not); the rest is summed and divided inside the core
    (the ring divides only each rank's reduced share)."""
    algorithm = all_reduce_algorithm(comm, tensor.numel() * tensor.element_size(), tensor.device)
    if tensor.dtype == torch.float16:
        tensor.div_(comm.world_size)
        return comm.all_reduce(tensor, op="sum", algorithm=algorithm, async_op=async_op)
    return comm.all_reduce(tensor, op="avg", algorithm=algorithm, async_op=async_op)


# -- what a compressor works on and keeps ------------------------------------------------------


@dataclass
class Bucket:
    """Gradients averaged as one: `grads`, shaped like their parameters; `flat`, one tensor they
    are views of (DDP's bucket), or None; `slot`, which memory the compressor keeps for them;
    `layout`, their parameters as ((id, numel), ...), for memory that follows its parameters
    when DDP rebuilds its buckets; `index`, DDP's bucket index, under which Communicator.stats()
    counts the bucket's operations; `is_last`, whether the step ends with this bucket."""

    grads: list
    slot: int
    flat: Optional[torch.Tensor] = None
    layout: Optional[tuple] = None
    index: Optional[int] = None
    is_last: bool = False

    @property
    def numel(self) -> int:
        return self.flat.numel() if self.flat is not None else sum(g.numel() for g in self.grads)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype if self.flat is not None else self.grads[0].dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device if self.flat is not None else self.grads[0].device

    def gradient(self) -> torch.Tensor:
        """The bucket's gradients as one contiguous flat tensor: flat itself where it is one,
        else a new one."""
        if self.flat is not None and self.flat.is_contiguous():
            return self.flat.view(-1)
        if self.flat is not None:
            return self.flat.reshape(-1).contiguous()
        return torch.cat([g.reshape(-1) for g in self.grads])


@dataclass
class Dense:
    """What compress() returns for a bucket that goes whole: `tensor`, flat, which the average
    takes the place of (average_densely), and why (`reason`: CompressionStats.dense_reasons, and
    logged at INFO on the "ringcomm" logger when a bucket's way of going changes)."""

    tensor: torch.Tensor
    reason: str


@dataclass
class CompressionStats:
    """Running totals since the compressor was created."""

    steps: int = 0
    compressed_buckets: int = 0
    dense_buckets: int = 0
    bytes_sent: int = 0  # measured on this rank's connections
    dense_bytes: int = 0  # what a ring all-reduce of the same buckets would have sent
    compress_seconds: float = 0.0  # compress(), on the caller's thread
    exchange_seconds: float = 0.0  # from the exchange's start to the average (decode included)
    dense_reasons: dict = field(default_factory=dict)  # why buckets went whole: reason -> count

    @property
    def compression_ratio(self) -> float:
        """Dense bytes over bytes actually sent (dense buckets included)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")


class Memory:
    """Tensors a compressor keeps per bucket between steps (error feedback's residual, a
    velocity: GRACE's memory), by name and slot, each shaped like the bucket's flat gradient.

    DDP rebuilds its buckets after its first iteration, with other parameters in each; given the
    bucket's layout (Bucket.layout), a slot whose parameters changed gets each parameter's piece
    from wherever it was kept. Without one, a change of shape or dtype starts the tensor at zero.
    """

    def __init__(self):
        self.tensors = {}  # name -> {slot: tensor}
        self._layouts = {}  # (name, slot) -> the layout its tensor was kept for
        self._retired = []  # tensors replaced this step: (name, tensor, layout), for their pieces
        self._prepared = []  # [zeroed block, elements handed out, prepared this step]

    def named(self, name: str) -> dict:
        """{slot: tensor} kept under `name`."""
        return self.tensors.setdefault(name, {})

    def get(self, name: str, bucket, like: torch.Tensor) -> torch.Tensor:
        """The tensor kept under `name` for `bucket` (a Bucket, or a slot), zeros like `like` (a
        flat tensor) the first time."""
        if isinstance(bucket, Bucket):
            slot, layout = bucket.slot, bucket.layout
        else:
            slot, layout = bucket, None
        store = self.named(name)
        t, known = store.get(slot), self._layouts.get((name, slot))
        if (
            t is not None
            and t.shape == like.shape
            and t.dtype == like.dtype
            and t.device == like.device
            and (layout is None or known is None or known == layout)
        ):
            if layout is not None:
                self._layouts[(name, slot)] = layout
            return t
        fresh = self._zeros(like)
        if layout is not None:
            self._move_pieces(name, fresh, layout)
        if t is not None:
            self._retired.append((name, t, known))  # its pieces may be wanted by other slots
        store[slot] = fresh
        self._layouts[(name, slot)] = layout
        return fresh

    def pop(self, name: str, slot: int) -> Optional[torch.Tensor]:
        """Removes and returns what `name` keeps for `slot` (None where nothing)."""
        return self.named(name).pop(slot, None)

    def prepare(self, like: torch.Tensor) -> None:
        """Zeroed memory for the tensors of the next step, shaped like `like` (a bucket's flat
        gradient), which get() carves its new tensors out of until that step ends: called once a
        step's all-reduce has started (Compressor.started), so that faulting in the pages (16.9 MB
        for the digits MLP's big bucket, 4,100 page faults, 100 ms of a 4-rank host's first
        compressed step) overlaps the wait for the network. A block stays allocated whole while
        any tensor carved out of it lives."""
        self._prepared.append(
            [torch.zeros_like(like, memory_format=torch.contiguous_format), 0, True]
        )

    def end_step(self) -> None:
        """Forgets what this step replaced, and the prepared blocks of the step before."""
        self._retired.clear()
        self._prepared = [block for block in self._prepared if block[2]]
        for block in self._prepared:
            block[2] = False  # prepared this step: for the next one only

    def state_dict(self) -> dict:
        return {
            name: {slot: t.clone() for slot, t in store.items()}
            for name, store in self.tensors.items()
        }

    def load_state_dict(self, state: dict) -> None:
        self.tensors = {
            name: {int(slot): t.clone() for slot, t in store.items()}
            for name, store in state.items()
        }
        self._layouts, self._retired, self._prepared = {}, [], []  # ids do not outlive a process

    def _zeros(self, like: torch.Tensor) -> torch.Tensor:
        numel = like.numel()
        for block in self._prepared:
            t, used, _ = block
            if t.dtype == like.dtype and t.device == like.device and t.numel() - used >= numel:
                block[1] = used + numel
                return t[used : used + numel]
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def _move_pieces(self, name: str, fresh: torch.Tensor, layout) -> None:
        kept = [(t, self._layouts.get((name, i))) for i, t in self.named(name).items()]
        kept += [(t, known) for n, t, known in self._retired if n == name]
        pieces = {}
        for t, known in kept:
            if known is None or t.dtype != fresh.dtype:
                continue
            offset = 0
            for pid, numel in known:
                pieces.setdefault((pid, numel), t[offset : offset + numel])
                offset += numel
        offset = 0
        for pid, numel in layout:
            piece = pieces.get((pid, numel))
            if piece is not None:
                fresh[offset : offset + numel].copy_(piece)
            offset += numel


def _completed(value=None) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


class Lane:
    """Keeps the collectives of a compressor's buckets in one order on every rank, where a bucket
    exchanges in several rounds, each issued from the completion of the one before, on the
    communicator's progress thread, while the caller's thread issues the next buckets: ranks
    whose threads interleave differently would issue them in different orders. A bucket issues
    its first collective only once the bucket before it has issued its last (rounds()). `name`
    names the compression in the reason a failure aborts the communicator with."""

    def __init__(self, name: str):
        self.name = name
        self._last = _completed()

    def enter(self):
        """(the Future of the bucket before, completed once it has issued its last collective;
        this bucket's, to complete once it has)."""
        previous, mine = self._last, torch.futures.Future()
        self._last = mine
        return previous, mine


def abort_on(comm, error: BaseException, name: str) -> None:
    """Aborts `comm` for an error of compression `name`'s own code in the middle of a bucket: the
    other ranks wait for messages this rank will not send, and learn why at once instead of at
    their timeout. A communicator broken already is left as it is."""
    if comm.broken is None:
        comm.abort(f"{name} failed on rank {comm.rank}: {type(error).__name__}: {error}")


def rounds(comm, lane: Lane, steps, device: Optional[torch.device] = None) -> torch.futures.Future:
    """Runs a bucket's rounds of collectives in the lane's order: steps[0](None) once the bucket
    before has issued its last, then each steps[i](value) with the value of the Work step i-1
    returned, from that Work's completion (on the progress thread). Each step returns a Work; the
    Future completes with the last one's value, or fails with the first error, which also aborts
    the communicator where it is the code's and not the communicator's.

    On a CUDA `device` the Future is CUDA-aware, steps[0] runs after the work on the caller's
    current stream (where what it sends was made, whichever thread runs it), and each later step
    on a stream after the collective before it (the Work's CUDA-aware future)."""
    previous, mine = lane.enter()
    made = None
    if device is not None and device.type == "cuda":
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(device))
    done = torch.futures.Future(devices=None if made is None else [device])

    def release():
        if not mine.done():
            mine.set_result(None)

    def fail(error):
        try:
            abort_on(comm, error, lane.name)
        finally:
            release()  # the buckets after this one fail on the aborted communicator
            if not done.done():
                done.set_exception(as_exception(error))

    def run(i, value):
        try:
            if i == 0 and made is not None:
                torch.cuda.current_stream(device).wait_event(made)
            work = steps[i](value)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the future
            fail(e)
            return
        if i + 1 == len(steps):
            release()
        work.get_future().add_done_callback(lambda fut: after(i, fut))

    def after(i, fut):
        try:
            value = fut.value()
        except BaseException as e:  # noqa: BLE001
            fail(e)
            return
        if i + 1 == len(steps):
            done.set_result(value)
        else:
            run(i + 1, value)

    previous.add_done_callback(lambda _: run(0, None))
    return done


def held_here(t: torch.Tensor) -> None:
    """A CUDA tensor made on another stream, kept from reuse until the current one is past what
    is enqueued on it now (a bucket's later rounds run on streams of their own)."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


# -- the interface ---------------------------------------------------------------------------


@dataclass(kw_only=True, eq=False)
class Compressor:
    """A gradient compression, split as GRACE splits one (Xu et al., 2021): compress() turns a
    bucket into what goes on the wire, exchange() starts the collectives that combine it over the
    ranks, decompress() turns what they return into the average; `memory` keeps what it needs
    from step to step (error feedback's residual) per bucket. GradientAverager, the DDP hooks
    (ringcomm.hooks.compressor_hook, topk_hook, ...) and bench/compression_quality.py call
    average(), which also counts `stats` (CompressionStats: buckets, bytes, seconds) and `step`.

    compress() may return Dense(tensor, reason) for a bucket that goes whole: average() then
    averages it (average_densely: with an algorithm that does not depend on timing), counts it
    and says so. A subclass that is no dataclass calls super().__init__(). Built on it:
    ringcomm.hooks.TopKState, PowerSGDState and QuantizeState.

    comm: a ringcomm Communicator or ringcomm process group the hooks average on (None: created
    from the default process group's store on first use, see hooks.communicator_for).
    """

    comm: Optional[object] = None
    step: int = 0
    stats: CompressionStats = field(default_factory=CompressionStats)
    memory: Memory = field(default_factory=Memory, repr=False)
    _step_start_bytes: Optional[int] = field(default=None, repr=False)
    _param_slots: dict = field(default_factory=dict, repr=False)  # compiled DDP: id(param) -> slot
    _ways: dict = field(default_factory=dict, repr=False)  # slot -> how it went last: reason or ""
    # A compressor whose buckets exchange in rounds keeps all its collectives in one Lane, the
    # whole buckets' too (average() issues those): None where every bucket issues at once.
    _lane: Optional[Lane] = field(default=None, repr=False)

    def compress(self, comm, bucket: Bucket):
        """On the caller's thread: what exchange() sends and decompress() needs, or Dense."""
        raise NotImplementedError

    def exchange(self, comm, bucket: Bucket, compressed) -> torch.futures.Future:
        """Starts the bucket's collectives on `comm`: a Future completed with what decompress()
        takes, or failed with the error. Several rounds: rounds()."""
        raise NotImplementedError

    def decompress(self, comm, bucket: Bucket, compressed, exchanged) -> Optional[torch.Tensor]:
        """The bucket's average: a tensor of bucket.numel elements (shaped like bucket.flat or
        flat), or None where it is written into bucket.grads."""
        raise NotImplementedError

    def started(self, comm, bucket: Bucket, compressed) -> None:
        """Called once the bucket's collectives are started: work that can overlap them."""

    def dense_reason(self, compressed) -> Optional[str]:
        """Why the bucket that compress() turned into `compressed` goes whole, or None where it is
        compressed. For compressors that send some buckets whole without Dense."""
        return compressed.reason if isinstance(compressed, Dense) else None

    def check_device(self, device: torch.device) -> None:
        """Raises ValueError for gradients on a device this compressor cannot average."""

    def slot_of_param(self, param, comm) -> int:
        """The memory slot of a parameter where compiled DDP calls the hook once per parameter,
        with no "last" flag: there the first parameter's call coming round again is what ends the
        previous step."""
        slot = self._param_slots.setdefault(id(param), len(self._param_slots))
        if slot == 0 and self._step_start_bytes is not None:
            self.end_step(comm)
        return slot

    def end_step(self, comm) -> None:
        """Called once every bucket of a step is averaged: counts the step and its bytes."""
        if self._step_start_bytes is not None:
            self.stats.bytes_sent += comm.bytes_sent - self._step_start_bytes
        self._step_start_bytes = None
        self.memory.end_step()
        self.step += 1
        self.stats.steps += 1

    def average(self, comm, bucket: Bucket) -> torch.futures.Future:
        """Starts averaging the bucket: a Future completed with decompress()'s result once it is
        ready (and the step ended, if the bucket is its last), or holding the error, as it was
        raised (a then() callback would hold it wrapped in a RuntimeError). For CUDA gradients
        the Future is CUDA-aware, and holds bucket.grads where decompress() returns None: a
        CUDA-aware Future makes its waiters' streams wait only for the tensors it holds."""
        stats = self.stats
        if self._step_start_bytes is None:
            self._step_start_bytes = comm.bytes_sent
        numel, dtype = bucket.numel, bucket.dtype
        world = comm.world_size
        stats.dense_bytes += 2 * (world - 1) * numel * dtype.itemsize // world
        started = time.perf_counter()
        compressed = self.compress(comm, bucket)
        exchanging = time.perf_counter()
        stats.compress_seconds += exchanging - started
        reason = self.dense_reason(compressed)
        self._note_way(bucket, reason, numel, dtype)
        if reason is None:
            stats.compressed_buckets += 1
        else:
            stats.dense_buckets += 1
            stats.dense_reasons[reason] = stats.dense_reasons.get(reason, 0) + 1
            if bucket.index is not None:
                comm.bucket_stats.count_dense(bucket.index)
        if isinstance(compressed, Dense):

            def dense(_):
                work = average_densely(comm, compressed.tensor)
                if bucket.index is not None:
                    comm.bucket_stats.add_work(bucket.index, work)
                return work

            if self._lane is None:
                exchanged = dense(None).get_future()
            else:
                exchanged = rounds(comm, self._lane, [dense], bucket.device)
        else:
            exchanged = self.exchange(comm, bucket, compressed)
        self.started(comm, bucket, compressed)
        # finish runs in the exchange's callback, on a stream after its collectives: on CUDA, the
        # waiters' streams wait for what it enqueued there
        on_cuda = bucket.device.type == "cuda"
        done = torch.futures.Future(devices=[bucket.device] if on_cuda else None)

        def finish(fut: torch.futures.Future) -> None:
            try:
                if isinstance(compressed, Dense):
                    average = compressed.tensor
                    if bucket.flat is not None:
                        average = average.view_as(bucket.flat)
                    fut.value()
                else:
                    average = self.decompress(comm, bucket, compressed, fut.value())
                stats.exchange_seconds += time.perf_counter() - exchanging
                if bucket.is_last:
                    self.end_step(comm)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the future
                done.set_exception(as_exception(e))
                return
            done.set_result(bucket.grads if average is None and on_cuda else average)

        exchanged.add_done_callback(finish)
        return done

    def _note_way(self, bucket: Bucket, reason: Optional[str], numel: int, dtype) -> None:
        """Logs at INFO when a bucket's way of going (compressed, or whole and why) changes."""
        way = reason or ""
        if self._ways.get(bucket.slot) == way:
            return
        self._ways[bucket.slot] = way
        what = f"goes whole ({reason})" if reason else "is compressed"
        logger.info(
            "%s: bucket %d (%s %s elements) %s from step %d",
            type(self).__name__,
            bucket.slot,
            f"{numel:,}",
            str(dtype).replace("torch.", ""),
            what,
            self.step,
        )


def as_exception(error: BaseException) -> Exception:
    """What a Future can hold (a KeyboardInterrupt, say, is no Exception)."""
    if isinstance(error, Exception):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")


def rank_key(*words: int) -> int:
    """A 64-bit key for a random stream from integers (seed, rank, slot, step, ...): different
    words give unrelated streams, the same words the same stream, on every machine."""
    key = 0
    for w in words:
        key = (key * 0x100000001B3 + (int(w) & ((1 << 64) - 1)) + 0x9E3779B97F4A7C15) % (1 << 64)
        key ^= key >> 29
    return key
