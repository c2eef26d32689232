"""The torch.distributed backend "ringcomm": a C++ c10d::Backend over the ringcomm core.

    import ringcomm                                   # registers the backend
    dist.init_process_group("ringcomm")               # or with store=, rank=, world_size=
    dist.new_group([0, 1], backend="ringcomm")
    dist.init_process_group("cpu:ringcomm,cuda:nccl") # CPU tensors through ringcomm

torch wraps the backend in a named ProcessGroup as it does gloo, so everything built on process
groups works: subgroups, DeviceMesh, FSDP2, DTensor, functional collectives, DDP.

CUDA tensors: every collective runs on the group's device path (ringcomm.device: CUDA IPC
between ranks of one host, any number of them per GPU, or NCCL) with ProcessGroupNCCL's stream
semantics; over CUDA IPC, send and recv too, sends on a stream of their own and receives on
another, once a
collective has joined the path (which takes every rank), and recv from any source raises there.
Sends and receives before that collective or over NCCL, the coalesced all-gather of lists, and
every operation on a device no device transport reaches are staged through pinned host memory
by the backend, counted in ringcomm.staging.bytes_to_host() and logged at INFO on the "ringcomm"
logger, once per operation and device. DDP hooks given the group as their state share its
device path.

The backend (csrc/torch/backend.cc, ringcomm._C_torch) is compiled against the installed torch
the first time it is needed, and cached (_extension.py): load() builds it, built() says whether
a build is there.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C
from ._extension import built as built, load  # built: for the callers of backend.built()
from .communicator import DEVICE_TRANSPORTS, Communicator
from .device import DevicePaths

BACKEND_NAME = "ringcomm"

logger = logging.getLogger("ringcomm")


class _DeviceRoute:
    """Where a ringcomm process group's operations on CUDA tensors run, asked by its backend
    (csrc/torch/backend.cc) with the GIL. The operations named in the module's docstring run on
    the group's device paths (which log, once per device, why
    one stages); each method returns the stream it enqueued its operation on, as (stream_id,
    device_index, device_type), or None where no device path serves: the backend then stages,
    as it does every other operation."""

    def __init__(self, paths: DevicePaths):
        self.paths = paths
        self._logged = set()

    def _run(self, tensors, body, tensor_factor=None):
        """body(path) on the path's stream after the caller's; `tensors` and the factor held
        until it is past them."""
        if tensor_factor is not None and tensor_factor.is_cuda:
            tensors = tensors + [tensor_factor]
        path = self.paths.get(tensors[0].device)
        if path is None:
            return None
        stream = path.run_after(tensors, lambda: body(path))
        return stream.stream_id, stream.device_index, stream.device_type

    @staticmethod
    def _scale(tensor, tensor_factor, factor):
        """PREMUL_SUM's factor applied (a tensor or a number, or neither)."""
        if tensor_factor is not None:
            tensor.mul_(tensor_factor.to(tensor.device))
        elif factor is not None:
            tensor.mul_(factor)

    def all_reduce(self, tensors: list, op: int, tensor_factor, factor):
        """Each of `tensors` all-reduced in place by `op` (a core op code), first scaled by the
        factor where one is given."""

        def body(path):
            for t in tensors:
                self._scale(t, tensor_factor, factor)
                path.all_reduce_on(t, op)

        return self._run(tensors, body, tensor_factor)

    def broadcast(self, tensor, root: int):
        """`root`'s tensor into every rank's: an all-gather in place in which only `root` has a
        block, so the bits arrive as sent."""
        counts = [tensor.numel() if r == root else 0 for r in range(self.paths.world_size)]
        return self._run([tensor], lambda path: path.all_gather_on(tensor.view(-1), counts))

    def _check_blocks(self, op: str, whole: str, wholes: list, block: str, blocks: list):
        """Each of `wholes` holds world_size of the matching one of `blocks`, in its dtype."""
        for w, b in zip(wholes, blocks):
            if w.dtype != b.dtype or w.numel() != self.paths.world_size * b.numel():
                raise ValueError(
                    f"ringcomm {op}: an {whole} of {w.numel()} {w.dtype} for an {block} of "
                    f"{b.numel()} {b.dtype} (expected world size x {block}, one dtype)"
                )

    def all_gather(self, outputs: list, inputs: list):
        """outputs[i] (world_size x inputs[i]'s elements) receives every rank's inputs[i]."""
        world, rank = self.paths.world_size, self.paths.rank
        self._check_blocks("allgather", "output", outputs, "input", inputs)

        def body(path):
            for o, i in zip(outputs, inputs):
                n = i.numel()
                o.view(-1)[rank * n : (rank + 1) * n].copy_(i.view(-1))
                path.all_gather_on(o.view(-1), [n] * world)

        return self._run(outputs + inputs, body)

    def _check_list(self, op: str, tensors: list, like):
        """`tensors` are world_size tensors of `like`'s elements and dtype."""
        world, n = self.paths.world_size, like.numel()
        if len(tensors) != world or any(t.dtype != like.dtype or t.numel() != n for t in tensors):
            raise ValueError(f"ringcomm {op}: needs {world} tensors of {n} {like.dtype} elements")

    def all_gather_list(self, outputs: list, input):
        """outputs[q] receives rank q's `input`."""
        self._check_list("allgather", outputs, input)
        return self.gather(outputs, input, None)

    def gather(self, outputs: list, input, root):
        """outputs[q] receives rank q's `input` at `root` (its outputs: the others pass none;
        None: every rank's, an all-gather): an exchange in which every rank sends its input to
        the root."""
        world, rank, n = self.paths.world_size, self.paths.rank, input.numel()
        if root is not None and rank == root:
            self._check_list("gather", outputs, input)

        def body(path):
            if root is None:
                flat = torch.empty(world * n, dtype=input.dtype, device=input.device)
                flat[rank * n : (rank + 1) * n].copy_(input.view(-1))
                path.all_gather_on(flat, [n] * world)
            else:
                size = world * n if rank == root else 0
                flat = torch.empty(size, dtype=input.dtype, device=input.device)
                recvs = [(q, q * n, n) for q in range(world)] if rank == root else []
                path.exchange_on(input.view(-1), flat, [(root, 0, n)], recvs, "gather", root, n)
            for q, o in enumerate(outputs):
                o.view(-1).copy_(flat[q * n : (q + 1) * n])

        return self._run(outputs + [input], body)

    def scatter(self, output, inputs: list, root: int):
        """`output` receives inputs[rank] of `root` (its inputs: the others pass none): an
        exchange in which the root sends each rank its part."""
        world, rank, n = self.paths.world_size, self.paths.rank, output.numel()
        if rank == root:
            self._check_list("scatter", inputs, output)

        def body(path):
            if rank == root:
                source = torch.cat([i.view(-1) for i in inputs])
                sends = [(q, q * n, n) for q in range(world)]
            else:
                source, sends = output.view(-1), []
            path.exchange_on(source, output.view(-1), sends, [(root, 0, n)], "scatter", root, n)

        return self._run([output] + inputs, body)

    def reduce(self, tensor, op: int, tensor_factor, factor, root: int):
        """`root`'s tensor receives every rank's reduced by `op`; the others' are left as they
        were: an all-reduce, in place at the root, of a copy elsewhere."""
        rank = self.paths.rank

        def body(path):
            target = tensor if rank == root else tensor.clone()
            self._scale(target, tensor_factor, factor)
            path.all_reduce_on(target, op)

        return self._run([tensor], body, tensor_factor)

    def _parts(self, tensor, splits: list, what: str) -> list:
        """(offset, count) in elements of each rank's part of `tensor`: `splits` rows of its
        first dimension each, or world_size equal parts where `splits` is empty."""
        world = self.paths.world_size
        rows = tensor.shape[0] if tensor.dim() else 1
        per_row = tensor.numel() // rows if rows else 0
        if not splits:
            if rows % world:
                raise ValueError(
                    f"ringcomm alltoall_base: {what} of {rows} rows, not a multiple of the world "
                    f"size {world}; give its splits"
                )
            splits = [rows // world] * world
        if len(splits) != world or any(r < 0 for r in splits) or sum(splits) != rows:
            raise ValueError(
                f"ringcomm alltoall_base: {what} splits {list(splits)} for {rows} rows and "
                f"{world} ranks"
            )
        offsets = [sum(splits[:q]) * per_row for q in range(world)]
        return [(offsets[q], splits[q] * per_row) for q in range(world)]

    def all_to_all(self, output, input, output_splits: list, input_splits: list):
        """Part q of `output` receives part `rank` of rank q's `input` (rows of the first
        dimension, by the splits, equal where none are given)."""
        world = self.paths.world_size
        if output.dtype != input.dtype:
            raise TypeError(
                f"ringcomm alltoall_base: input of {input.dtype}, output of {output.dtype}"
            )
        sends = self._parts(input, input_splits, "input")
        recvs = self._parts(output, output_splits, "output")

        # Always an exchange, equal parts or not: whether a rank's parts are equal, or given,
        # is its own; the ranks must agree on what runs.
        def body(path):
            path.exchange_on(
                input.view(-1),
                output.view(-1),
                [(q, *sends[q]) for q in range(world)],
                [(q, *recvs[q]) for q in range(world)],
                "all_to_all",
                -1,
                0,
            )

        return self._run([output, input], body)

    def all_to_all_list(self, outputs: list, inputs: list):
        """outputs[q] receives rank q's inputs[rank]: an exchange of the inputs back to back."""
        world = self.paths.world_size
        if any(t.dtype != inputs[0].dtype for t in outputs + inputs):
            raise TypeError("ringcomm alltoall: tensors of one dtype")
        ins = [t.numel() for t in inputs]
        outs = [t.numel() for t in outputs]

        def body(path):
            source = torch.cat([t.view(-1) for t in inputs])
            flat = torch.empty(sum(outs), dtype=outputs[0].dtype, device=outputs[0].device)
            path.exchange_on(
                source,
                flat,
                [(q, sum(ins[:q]), ins[q]) for q in range(world)],
                [(q, sum(outs[:q]), outs[q]) for q in range(world)],
                "all_to_all",
                -1,
                0,
            )
            for q, o in enumerate(outputs):
                o.view(-1).copy_(flat[sum(outs[:q]) : sum(outs[:q]) + outs[q]])

        return self._run(outputs + inputs, body)

    def send(self, tensor, dst: int, tag: int):
        """`tensor` to rank `dst`, on the path's stream for the sends to it (DeviceCommunicator.
        send)."""
        return self._message(tensor, dst, True, tag)

    def recv(self, tensor, src: int, tag: int):
        """Rank `src`'s matching send into `tensor`."""
        return self._message(tensor, src, False, tag)

    def _message(self, tensor, peer: int, send: bool, tag: int):
        """Over CUDA IPC on the device path once a collective has joined it: a send or receive
        involves two ranks, and joining takes every rank. Before, staged, as its peer's is; over
        NCCL staged too, whose sends and receives on the collectives' communicator could wait
        on those (ProcessGroupNCCL gives each pair a communicator of its own)."""
        path = self.paths.joined_on(tensor.device)
        if path is None or path.transport != "cuda_ipc":
            self.staged("SEND" if send else "RECV", str(tensor.device))
            return None
        stream = path.enqueue_message(tensor, peer, send, tag)
        return stream.stream_id, stream.device_index, stream.device_type

    def recv_any(self, tensor):
        """None (staged) before a device path is joined; after, sends of CUDA tensors run
        there, where a receive names its source."""
        path = self.paths.joined_on(tensor.device)
        if path is not None and path.transport == "cuda_ipc":
            raise ValueError(
                f"recv from any source: sends of CUDA tensors on {tensor.device} run on the "
                f"device path, where a receive names its source (src=)"
            )
        return None

    def reduce_scatter(self, outputs: list, inputs: list, op: int, tensor_factor, factor):
        """outputs[i] receives this rank's block of inputs[i] (world_size x outputs[i]'s
        elements) reduced over the ranks: a reduce-scatter of a copy of the input, in place."""
        rank = self.paths.rank
        self._check_blocks("reduce_scatter", "input", inputs, "output", outputs)

        def body(path):
            for o, i in zip(outputs, inputs):
                n = o.numel()
                reduced = i.reshape(-1).clone()  # the input is not the caller's to change
                self._scale(reduced, tensor_factor, factor)
                path.reduce_scatter_on(reduced, op)
                o.view(-1).copy_(reduced[rank * n : (rank + 1) * n])

        return self._run(outputs + inputs, body, tensor_factor)

    def staged(self, op: str, device: str) -> None:
        """Logs, once per operation and device, that the backend stages `op`."""
        if (op, device) not in self._logged:
            self._logged.add((op, device))
            logger.info(
                "ringcomm: rank %d of %d stages %s of CUDA tensors on %s through host memory: "
                "the device path does not carry it",
                self.paths.rank,
                self.paths.world_size,
                op,
                device,
            )

    def close(self) -> None:
        self.paths.close()

    def abort(self) -> None:
        self.paths.abort()


def _create(store, rank: int, world_size: int, timeout: timedelta):
    backend = load().RingcommBackend(store, rank, world_size, timeout)
    paths = DevicePaths(
        dist.PrefixStore("ringcomm/device", store), rank, world_size, timeout, DEVICE_TRANSPORTS
    )
    backend.set_device_route(_DeviceRoute(paths))
    return backend


def register_backend():
    """Registers "ringcomm" with torch.distributed (done on `import ringcomm`; idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        # One backend serves both device types (module docstring).
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


def backend_of(group=None):
    """The ringcomm backend behind `group`'s CPU tensors (default: the default group), or None."""
    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in a _ProcessGroupWrapper.
    backend = getattr(backend, "wrapped_pg", backend)
    return backend if isinstance(backend, load().RingcommBackend) else None


# The borrowed Communicator of each group: hooks ask for it on every bucket.
_borrowed = weakref.WeakKeyDictionary()
_borrowed_lock = threading.Lock()


def communicator_of(group=None) -> Communicator:
    """A ringcomm.Communicator over the same core communicator as `group`'s ringcomm backend:
    operations issued through either run in one order. The group owns it (close() does nothing)."""
    group = group if group is not None else dist.group.WORLD
    with _borrowed_lock:
        comm = _borrowed.get(group) if isinstance(group, dist.ProcessGroup) else None
        if comm is not None:
            return comm
        backend = backend_of(group)
        if backend is None:
            raise ValueError(
                f"{group!r} is not a process group with a ringcomm backend for CPU tensors"
            )
        core = _C.Communicator.from_capsule(backend.communicator_capsule())
        comm = Communicator._borrow(core, timedelta(minutes=10), backend.device_route().paths)
        _borrowed[group] = comm
        return comm
