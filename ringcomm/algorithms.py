"""Collectives written in Python: one rank's steps over blocks of the buffer, in the primitives of
the core's step lists, checked before they run and run by the core's executor over every
transport (docs/algorithms.md, "Writing a collective").

    from ringcomm.algorithms import Program, check, register

    def ring(rank, n):                       # rank `rank`'s steps among n ranks
        p = Program(blocks=n)                # the buffer in n blocks
        ...                                  # p.send(block, dst), p.recv_reduce_send(...), ...
        return p

    check(ring, range(2, 9))                 # ValueError naming the rank, step and block at fault
    register("my_ring", ring)                # checked where it runs, before a byte is sent
    comm.all_reduce(t, algorithm="my_ring")  # or RINGCOMM_ALGO=my_ring for the auto calls

A program's steps run in order. Each names a block (0 .. blocks-1) and peers by rank:

    send(b, dst)                      block b's value to dst
    recv(b, src)                      block b from src, in place of this rank's
    recv_send(b, src, dst)            the same, then on to dst
    recv_reduce(b, src)               block b from src, combined with this rank's: mine (op)
                                      incoming, or with incoming_first=True incoming (op) mine
    recv_reduce_send(b, src, dst)     the same, then the result on to dst
    exchange_reduce(b, peer)          send block b to peer and receive peer's, then combine them

An algorithm that takes a third argument, (rank, world_size, nbytes), gets the size class of the
message (the largest power of two <= its bytes, or 0), and may return other programs for other
classes: its lists are then built and checked once per world size and size class, where the others'
are once per world size.

A block larger than the slice travels in slices: by step (pipeline="step", the ring's way) each
step over all of its block's slices, a slice forwarded as soon as it is combined; by slice
(pipeline="slice", the trees' way) in rounds of every step over one slice each, a step with
lag=k working k slices behind. Broadcast and reduce programs are written for root 0; the core
renumbers the ranks from the root it is given. The steps where a block becomes complete (where
op="avg" divides) are found by the check.
"""

from __future__ import annotations

import atexit
import inspect
import runpy
from typing import Callable, Iterable, Optional

from . import _C
from ._env import env_int, env_string

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
_PRIMITIVES = _C.PRIMITIVE_CODES

Algorithm = Callable[..., "Program"]
# The size classes check() and register() try an algorithm that asks for them at: 0 B .. 1 GiB.
SIZE_CLASSES = (0, *(1 << k for k in range(31)))


class Program:
    """Rank's steps of `collective` over the buffer cut into `blocks` blocks (reduce_scatter and
    all_gather: every rank's share cut into blocks / world_size, rank r's share being blocks
    r * blocks / world_size onwards). slice_bytes: the slice blocks travel in; None the
    pipeline's own (by step RINGCOMM_RING_SLICE_BYTES, by slice RINGCOMM_TREE_CHUNK_BYTES), 0
    whole blocks. Every rank's program must agree on all four."""

    __slots__ = ("collective", "blocks", "pipeline", "slice_bytes", "steps")

    def __init__(
        self,
        blocks: int,
        collective: str = "all_reduce",
        pipeline: str = "step",
        slice_bytes: Optional[int] = None,
    ):
        if collective not in COLLECTIVES:
            raise ValueError(f"collective {collective!r}: one of {', '.join(COLLECTIVES)}")
        if pipeline not in ("step", "slice"):
            raise ValueError(f"pipeline {pipeline!r}: 'step' or 'slice'")
        if slice_bytes is not None and int(slice_bytes) < 0:
            raise ValueError(f"slice_bytes {slice_bytes} is negative")
        self.collective, self.blocks, self.pipeline = collective, int(blocks), pipeline
        self.slice_bytes = None if slice_bytes is None else int(slice_bytes)
        self.steps = []  # (primitive code, block, src, dst, incoming_first, lag)

    def _add(self, prim, block, src=-1, dst=-1, incoming_first=False, lag=0):
        self.steps.append(
            (_PRIMITIVES[prim], int(block), int(src), int(dst), bool(incoming_first), int(lag))
        )
        return self

    def send(self, block: int, dst: int, lag: int = 0):
        return self._add("send", block, dst=dst, lag=lag)

    def recv(self, block: int, src: int, lag: int = 0):
        return self._add("recv", block, src=src, lag=lag)

    def recv_send(self, block: int, src: int, dst: int, lag: int = 0):
        return self._add("recv_send", block, src, dst, lag=lag)

    def recv_reduce(self, block: int, src: int, incoming_first: bool = False, lag: int = 0):
        return self._add("recv_reduce", block, src, incoming_first=incoming_first, lag=lag)

    def recv_reduce_send(
        self, block: int, src: int, dst: int, incoming_first: bool = False, lag: int = 0
    ):
        return self._add("recv_reduce_send", block, src, dst, incoming_first, lag)

    def exchange_reduce(self, block: int, peer: int, incoming_first: bool = False, lag: int = 0):
        return self._add("exchange_reduce", block, dst=peer, incoming_first=incoming_first, lag=lag)

    def _shape(self):
        return (
            self.collective,
            self.blocks,
            self.pipeline,
            -1 if self.slice_bytes is None else self.slice_bytes,
        )


def _sized(algorithm: Algorithm) -> bool:
    """Whether the algorithm takes the message's size class as a third argument."""
    try:
        parameters = inspect.signature(algorithm).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: (rank, world_size)
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in parameters) >= 3


def size_class(nbytes: int) -> int:
    """The size class of a message of `nbytes`: the largest power of two <= nbytes, or 0."""
    return 1 << (int(nbytes).bit_length() - 1) if nbytes > 0 else 0


def _lists(name: str, algorithm: Algorithm, n: int, nbytes: int = 0) -> tuple:
    """Every rank's program among n ranks (for messages of nbytes' size class, where the
    algorithm asks), as the core takes them."""
    sized = _sized(algorithm)
    programs = []
    for rank in range(n):
        try:
            program = algorithm(rank, n, size_class(nbytes)) if sized else algorithm(rank, n)
        except Exception as e:
            raise ValueError(
                f"algorithm {name!r} ({n} ranks): rank {rank}'s program raised "
                f"{type(e).__name__}: {e}"
            ) from e
        if not isinstance(program, Program):
            raise ValueError(
                f"algorithm {name!r} ({n} ranks): rank {rank}'s program is a "
                f"{type(program).__name__}, not a ringcomm.algorithms.Program"
            )
        if programs and program._shape() != programs[0]._shape():
            words = ("collective", "blocks", "pipeline", "slice_bytes")
            a, b = programs[0]._shape(), program._shape()
            diff = next(w for w, x, y in zip(words, a, b) if x != y)
            raise ValueError(
                f"algorithm {name!r} ({n} ranks): rank {rank}'s program has "
                f"{diff} {getattr(program, diff)!r} where rank 0's has "
                f"{getattr(programs[0], diff)!r}"
            )
        programs.append(program)
    return programs[0]._shape() + (size_class(nbytes) if sized else -1, [p.steps for p in programs])


def _name_of(algorithm: Algorithm) -> str:
    return getattr(algorithm, "__name__", type(algorithm).__name__)


def check(
    algorithm: Algorithm, world_sizes: Iterable[int], sizes: Optional[Iterable[int]] = None
) -> dict:
    """Runs every rank's program among each of `world_sizes` ranks symbolically, as the core's
    executor would, and raises ValueError, naming the rank, the step and the block, unless: every
    step names a block and another rank; the programs fit together (no deadlock, every message
    received as the block its receiver expects, no block written while a send of it may still be
    read), also slice by slice where pipelined by slice; every block ends where the collective
    puts it with every rank's contribution once, combined in the same order on every rank that
    ends with it (so results are bitwise equal); and all_gather and broadcast only move blocks.

    Returns {world size: {"id", "orders": each block's order of combination, "((0 1) 2)" for
    (x0 op x1) op x2, "steps": each rank's steps as the core runs them}}; for an algorithm that
    takes the size class, keyed by (world size, size class) for the classes of `sizes` (bytes;
    default SIZE_CLASSES)."""
    name = _name_of(algorithm)
    if not _sized(algorithm):
        return {n: _C.check_algorithm(name, _lists(name, algorithm, n)) for n in world_sizes}
    classes = sorted({size_class(b) for b in (SIZE_CLASSES if sizes is None else sizes)})
    return {
        (n, c): _C.check_algorithm(name, _lists(name, algorithm, n, c))
        for n in world_sizes
        for c in classes
    }


_registered: dict[str, Algorithm] = {}
_loaded_files: set[str] = set()
_BUILT_IN = (
    set(_C.ALGORITHM_CODES)
    | set(_C.SPARSE_ALGORITHM_CODES)
    | {"chain", "binomial", "dissemination", "direct", "nccl", "one_shot", "registered"}
)


def register(
    name: str,
    algorithm: Algorithm,
    world_sizes: Optional[Iterable[int]] = None,
    sizes: Optional[Iterable[int]] = None,
):
    """Registers `algorithm` (a function of (rank, world_size), or of (rank, world_size, nbytes),
    returning that rank's Program) under `name`, for `comm.<collective>(..., algorithm=name)` and
    RINGCOMM_ALGO=name (all_reduce). Checks it first among each of `world_sizes` ranks (default:
    WORLD_SIZE's, where set; for each size class of `sizes` where it takes one, default
    SIZE_CLASSES), and registers nothing if a check fails; a world size (or size class) not
    checked here is checked where it is first used, on every rank alike, before anything is
    sent. Registering a name again replaces
    its algorithm from the next call on (every rank must do so before that call: ranks that run
    different lists fail as a mismatch)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"algorithm name {name!r}: a Python identifier")
    if name in _BUILT_IN:
        raise ValueError(f"algorithm name {name!r} is a built-in algorithm's")
    if not callable(algorithm):
        raise TypeError(
            f"algorithm {name!r}: a function of (rank, world_size), got {type(algorithm).__name__}"
        )
    if world_sizes is None:
        size = env_int("WORLD_SIZE")
        world_sizes = [size] if size is not None and size > 1 else []
    classes = sorted({size_class(b) for b in (SIZE_CLASSES if sizes is None else sizes)})
    for n in world_sizes:
        for c in classes if _sized(algorithm) else [0]:
            _C.check_algorithm(name, _lists(name, algorithm, int(n), c))
    _registered[name] = algorithm
    _C.forget_algorithm(name)


def unregister(name: str):
    """Forgets the algorithm registered under `name`."""
    _registered.pop(name, None)
    _C.forget_algorithm(name)


def registered() -> dict[str, Algorithm]:
    """The registered algorithms by name (RINGCOMM_ALGORITHM_FILE's loaded first)."""
    _load_file()
    return dict(_registered)


def lists(name: str, collective: str, world_size: int, nbytes: int = 0) -> Optional[dict]:
    """What the core runs for registered algorithm `name` among `world_size` ranks for a message
    of `nbytes` (as check() returns for one world size, without the orders), or None where no
    such name is registered."""
    return _C.registered_algorithm(name, collective, int(world_size), int(nbytes))


def _load_file() -> bool:
    """Runs RINGCOMM_ALGORITHM_FILE once; whether it ran now."""
    path = env_string("RINGCOMM_ALGORITHM_FILE")
    if not path or path in _loaded_files:
        return False
    _loaded_files.add(path)
    try:
        runpy.run_path(path, run_name="ringcomm_algorithm_file")
    except Exception as e:
        raise ValueError(f"RINGCOMM_ALGORITHM_FILE={path}: {type(e).__name__}: {e}") from e
    return True


def _source(name: str, world_size: int, nbytes: int):
    """The core's source of registered lists (algorithms/registered.h)."""
    algorithm = _registered.get(name)
    if algorithm is None and _load_file():
        algorithm = _registered.get(name)
    if algorithm is None:
        return None
    return () if world_size == 0 else _lists(name, algorithm, world_size, nbytes)


_C.set_algorithm_source(_source)
atexit.register(_C.set_algorithm_source, None)  # the core outlives the interpreter
