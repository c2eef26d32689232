"""The torch.distributed backend "ringcomm": a C++ c10d::Backend over the ringcomm core.

    import ringcomm                                   # registers the backend
    dist.init_process_group("ringcomm")               # or with store=, rank=, world_size=
    dist.new_group([0, 1], backend="ringcomm")
    dist.init_process_group("cpu:ringcomm,cuda:nccl") # CPU tensors through ringcomm

torch wraps the backend in a named ProcessGroup as it does gloo, so everything built on process
groups works: subgroups, DeviceMesh, FSDP2, DTensor, functional collectives, DDP.

CUDA tensors: all_reduce (and its coalesced form, DDP's), broadcast, reduce, the all-gathers,
gather, scatter, the reduce-scatters into tensors and all_to_all_single with equal splits run on
the group's device path (ringcomm.device: CUDA IPC between ranks of one host, any number of them
per GPU, or NCCL) with ProcessGroupNCCL's stream semantics; send/recv, the list forms of
all_to_all and reduce_scatter, uneven splits, and every operation on a device no device
transport reaches, are staged through pinned host memory by the backend, counted in
ringcomm.staging.bytes_to_host() and logged at INFO on the "ringcomm" logger, once per operation
and device. DDP hooks given the group as their state share its device path.

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
        None: every rank's): an all-gather, of which the root keeps the blocks."""
        world, rank, n = self.paths.world_size, self.paths.rank, input.numel()
        if root is not None and rank == root:
            self._check_list("gather", outputs, input)

        def body(path):
            flat = torch.empty(world * n, dtype=input.dtype, device=input.device)
            flat[rank * n : (rank + 1) * n].copy_(input.view(-1))
            path.all_gather_on(flat, [n] * world)
            for q, o in enumerate(outputs):
                o.view(-1).copy_(flat[q * n : (q + 1) * n])

        return self._run(outputs + [input], body)

    def scatter(self, output, inputs: list, root: int):
        """`output` receives inputs[rank] of `root` (its inputs: the others pass none): an
        all-gather in which only the root has a block, the whole list, each rank keeping its
        part."""
        world, rank, n = self.paths.world_size, self.paths.rank, output.numel()
        if rank == root:
            self._check_list("scatter", inputs, output)

        def body(path):
            flat = torch.empty(world * n, dtype=output.dtype, device=output.device)
            for q, i in enumerate(inputs):
                flat[q * n : (q + 1) * n].copy_(i.view(-1))
            path.all_gather_on(flat, [world * n if r == root else 0 for r in range(world)])
            output.view(-1).copy_(flat[rank * n : (rank + 1) * n])

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

    def all_to_all(self, output, input):
        """Equal splits: block q of `output` receives block `rank` of rank q's `input`."""
        world = self.paths.world_size
        if output.dtype != input.dtype or output.numel() != input.numel() or input.numel() % world:
            raise ValueError(
                f"ringcomm alltoall_base: input and output of one dtype and size, a multiple of "
                f"the world size {world}; got {input.numel()} {input.dtype} and "
                f"{output.numel()} {output.dtype}"
            )

        def body(path):
            output.view(-1).copy_(input.view(-1))
            path.all_to_all_on(output.view(-1))

        return self._run([output, input], body)

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
