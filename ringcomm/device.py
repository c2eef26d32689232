"""CUDA tensors on ringcomm's device path: collectives enqueued on the current CUDA stream over
the first device transport that serves every rank.

    comm = ringcomm.device.DeviceCommunicator(store, rank, world_size)  # current CUDA device
    comm.transport          # "cuda_ipc" or "nccl"; comm.refused: why not the others
    comm.all_reduce(t)      # in place, on t's current stream; op="sum" | "avg" | "min" ...
    comm.all_gather(out, t) # every rank's t into out (world_size x t), on t's current stream
    comm.reduce_scatter(out, t)  # block `rank` of t (world_size x out) reduced over the ranks
    comm.all_to_all(out, t) # block q of out receives block `rank` of rank q's t
                            # algorithm="auto" | "one_shot" | "shared_buffer" | "ring" (cuda_ipc)
                            # | "ring" | "tree" | "recursive_doubling" | "nccl" (nccl)
    work = comm.send(t, dst) # t to rank dst, whose k-th recv from this rank takes the k-th
    work = comm.recv(t, src) # send: sends on a stream of their own, receives on another
    comm.synchronize()      # waits; raises if a peer failed or the timeout passed
    work = comm.all_reduce_work(t, async_op=True)   # on the communicator's own stream, after
                            # the current one's work (ProcessGroupNCCL's semantics: DeviceWork)
    work = comm.sparse_all_reduce_work(indices, values, counts, out)  # top-k's exchange:
                            # the pairs gathered, scatter-added in rank order
    comm.close()            # every rank, after synchronize()

ringcomm.Communicator makes one of these per CUDA device at its first all_reduce of a tensor on
that device, and runs its CUDA all_reduces through all_reduce_work.

The transports, tried in this order (`transports=` narrows it):
  cuda_ipc  ranks of one host, any number of them on one GPU (csrc/transport/cuda_ipc/): each
            rank's window mapped by the others, the window plans' kernels reading it in place;
  nccl      one GPU per rank (csrc/transport/nccl/): ringcomm's step lists over ncclSend/ncclRecv.
Each one a rank cannot use is refused on every rank, with the reason logged at INFO on the
"ringcomm" logger, before the next is tried; where none serves, every rank raises
NoDeviceTransport (ringcomm.Communicator then stages its CUDA tensors through host memory).

Every wait on a peer is bounded by `timeout` (cuda_ipc: a watchdog thread releases the stream
and the next call raises, naming the rank that gave up and why); abort() gives up at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from datetime import timedelta
from typing import Optional, Sequence

import torch

from . import _C, cuda, nccl
from ._buffers import TORCH_DTYPES, op_code

logger = logging.getLogger("ringcomm")

TRANSPORTS = ("cuda_ipc", "nccl")
# A board round of the window plans (csrc/algorithms/window_plan.h): each rank's window holds
# about 2.25x this, plus one round's bytes for each rank (the ring's and the sends' inboxes).
ROUND_BYTES = 8 << 20


class NoDeviceTransport(RuntimeError):
    """None of the transports offered serves every rank; `refused` says why, by transport. Every
    rank raises it at the same call, with the same reasons."""

    def __init__(self, refused: dict):
        self.refused = dict(refused)
        super().__init__(
            "no transport serves these ranks: "
            + "; ".join(f"{t}: {why}" for t, why in self.refused.items())
        )


class DeviceCommunicator:
    """`world_size` ranks joined through `store` (a torch.distributed Store) on CUDA `device`
    (default: the current one). Blocks until every rank has joined; every rank must make it with
    the same `name`, `transports` and `round_bytes`."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        device: Optional[torch.device] = None,
        timeout: timedelta = timedelta(minutes=10),
        transports: Sequence[str] = TRANSPORTS,
        name: str = "ringcomm-device",
        round_bytes: int = ROUND_BYTES,
    ):
        unknown = [t for t in transports if t not in TRANSPORTS]
        if unknown or not transports:
            raise ValueError(f"transports must be some of {TRANSPORTS}, got {tuple(transports)}")
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        self.rank, self.world_size, self.timeout = int(rank), int(world_size), timeout
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device must be a CUDA device with an index, got {self.device}")
        self._store = store
        # A communicator made again under the same name must not read the keys of the one
        # before: each world_size joins make one generation.
        generation = (store.add(f"{name}/joins", 1) - 1) // self.world_size
        self._prefix = f"{name}/{generation}"
        self._rounds = 0
        self._comm = None
        self._stream = None  # all_reduce_work's, with its two reusable events; made on first use
        self._message_streams = {}  # send (True) or receive (False): the stream of either
        self._ready = self._done = None
        # sparse_all_reduce's flag of an index outside the output, and its copy on the host
        self._bad = self._bad_host = self._bad_copied = None
        self._lock = threading.Lock()
        self.transport = None
        self.refused = {}
        for transport in transports:
            why = getattr(self, f"_connect_{transport}")(round_bytes)
            if not why:
                self.transport = transport
                break
            self.refused[transport] = why
            logger.info(
                "ringcomm: rank %d of %d does not use %s: %s",
                self.rank,
                self.world_size,
                transport,
                why,
            )
        if self.transport is None:
            raise NoDeviceTransport(self.refused)
        self._codes = cuda._load()[0].DEVICE_ALGORITHM_CODES

    # Set-up: every rank takes each decision from what every rank said.

    def _exchange(self, payload: bytes) -> list:
        """Every rank's payload, in rank order."""
        key = f"{self._prefix}/{self._rounds}"
        self._rounds += 1
        self._store.set(f"{key}/{self.rank}", payload)
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        self._store.wait(keys, self.timeout)
        return [self._store.get(k) for k in keys]

    def _agree(self, why: str) -> str:
        """ "" if no rank has a reason to refuse, else the first rank's."""
        for r, theirs in enumerate(self._exchange(why.encode())):
            if theirs:
                return f"rank {r}: {theirs.decode()}"
        return ""

    def _connect_cuda_ipc(self, round_bytes: int) -> str:
        module, why = cuda._load()
        why = self._agree(why or "")
        if why:
            return why
        self._comm, why = module.ipc_communicator(
            self.rank,
            self.world_size,
            self.device.index,
            int(round_bytes),
            self.timeout.total_seconds(),
            self._exchange,
        )
        return why

    def _connect_nccl(self, round_bytes: int) -> str:
        module, why = cuda._load()
        why = self._agree(why or "")
        if why:
            return why
        gpus = [
            g.decode()
            for g in self._exchange(
                str(torch.cuda.get_device_properties(self.device).uuid).encode()
            )
        ]
        for r, g in enumerate(gpus):
            if gpus.index(g) != r:
                return f"ranks {gpus.index(g)} and {r} share GPU {g}; NCCL takes one GPU per rank"
        unique_id, why = b"", ""
        if self.rank == 0:
            try:
                unique_id = nccl.unique_id()
            except Exception as e:  # noqa: BLE001 - no NCCL library: every rank refuses it
                why = str(e)
        why = self._agree(why)
        if why:
            return why
        ids = self._exchange(unique_id)
        self._comm = module.nccl_communicator(
            nccl.library_path(), ids[0], self.rank, self.world_size, self.device.index
        )
        return ""

    # Collectives.

    def all_reduce(self, tensor: torch.Tensor, op="sum", algorithm: str = "auto") -> torch.Tensor:
        """In place, enqueued on the current stream of the tensor's device. `algorithm` names
        one of the transport's (the module's docstring)."""
        cuda._check(tensor, "tensor", device=self.device)
        with self._lock:  # the transport's counts follow the order of calls
            self._enqueue(tensor, op, algorithm, torch.cuda.current_stream(self.device))
        return tensor

    def _enqueue(self, tensor: torch.Tensor, op, algorithm: str, stream: torch.cuda.Stream):
        code = self._codes.get(algorithm)
        if code is None:
            raise ValueError(
                f"unknown algorithm {algorithm!r}; expected one of " + ", ".join(self._codes)
            )
        self._comm.all_reduce(
            tensor.data_ptr(),
            tensor.numel(),
            TORCH_DTYPES[tensor.dtype],
            op_code(op),
            code,
            stream.cuda_stream,
        )

    def all_reduce_work(
        self, tensor: torch.Tensor, op="sum", algorithm: str = "auto", async_op: bool = True
    ) -> Optional["DeviceWork"]:
        """all_reduce with ProcessGroupNCCL's stream semantics: enqueued on this communicator's
        own stream after the work already on the tensor's current stream, the tensor held
        (record_stream) until that stream is past it. async_op: a DeviceWork; else None, the
        current stream made to wait for it (the host is not blocked)."""
        caller = torch.cuda.current_stream(self.device)
        with self._lock:  # the events are shared, and the stream's order is the ranks' order
            own = self._enqueue_after(caller, [tensor], op, algorithm)
            return self._finish(caller, own, tensor, async_op)

    def run_after(self, tensors: Sequence[torch.Tensor], body) -> torch.cuda.Stream:
        """Runs body() with this communicator's own stream current, after the work already on
        the current stream, and holds `tensors` until that stream is past what body() enqueued
        there (all_gather_on, all_reduce_on, exchange_on, torch ops); returns the stream. For
        composite operations: the torch backend's broadcast, all-gathers, reduce-scatters,
        gather, scatter and all-to-alls."""
        caller = torch.cuda.current_stream(self.device)
        with self._lock:
            own = self._own_after(caller)
            with torch.cuda.stream(own):
                body()
            for t in tensors:
                t.record_stream(own)
            return own

    def all_gather_on(self, flat: torch.Tensor, counts: Sequence[int], stream=None) -> None:
        """Inside run_after's body (or, with the lock held, on `stream`): the all-gather into
        `flat`, every rank's block back to back (counts[q] elements from rank q, this rank's
        already in place)."""
        self._comm.all_gather(
            flat.data_ptr(),
            [int(c) for c in counts],
            TORCH_DTYPES[flat.dtype],
            (stream or self._stream).cuda_stream,
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Every rank's `input` into `output` (world_size times its elements, rank q's as block
        q), enqueued on the current stream of their device, as all_reduce is."""
        cuda._check(input, "input", device=self.device)
        cuda._check(output, "output", (input.dtype,), device=self.device)
        n = input.numel()
        if output.numel() != self.world_size * n:
            raise ValueError(
                f"output has {output.numel()} elements, expected world_size x input = "
                f"{self.world_size * n}"
            )
        output.view(-1)[self.rank * n : (self.rank + 1) * n].copy_(input.view(-1))
        with self._lock:  # the transport's counts follow the order of calls
            self.all_gather_on(
                output.view(-1), [n] * self.world_size, torch.cuda.current_stream(self.device)
            )
        return output

    def reduce_scatter_on(self, flat: torch.Tensor, op="sum", stream=None) -> None:
        """Inside run_after's body (or, with the lock held, on `stream`): the reduce-scatter of
        `flat`, world_size blocks back to back; block `rank` ends reduced in place, the others
        hold scratch."""
        self._comm.reduce_scatter(
            flat.data_ptr(),
            flat.numel() // self.world_size,
            TORCH_DTYPES[flat.dtype],
            op_code(op),
            (stream or self._stream).cuda_stream,
        )

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum") -> torch.Tensor:
        """Block `rank` of `input` (world_size times output's elements) reduced over the ranks
        into `output`, enqueued on the current stream of their device, as all_reduce is; `input`
        is left as it was."""
        cuda._check(input, "input", device=self.device)
        cuda._check(output, "output", (input.dtype,), device=self.device)
        n = output.numel()
        if input.numel() != self.world_size * n:
            raise ValueError(
                f"input has {input.numel()} elements, expected world_size x output = "
                f"{self.world_size * n}"
            )
        scratch = input.reshape(-1).clone()  # the reduction runs in place
        with self._lock:  # the transport's counts follow the order of calls
            self.reduce_scatter_on(scratch, op, torch.cuda.current_stream(self.device))
        output.view(-1).copy_(scratch[self.rank * n : (self.rank + 1) * n])
        return output

    def all_to_all_on(self, flat: torch.Tensor, stream=None) -> None:
        """Inside run_after's body (or, with the lock held, on `stream`): the all-to-all of
        `flat` in place, world_size blocks back to back; block q receives block `rank` of rank
        q's."""
        self._comm.all_to_all(
            flat.data_ptr(),
            flat.numel() // self.world_size,
            TORCH_DTYPES[flat.dtype],
            (stream or self._stream).cuda_stream,
        )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Block q of `output` receives block `rank` of rank q's `input` (both world_size equal
        blocks), enqueued on the current stream of their device, as all_reduce is; `input` is
        left as it was."""
        cuda._check(input, "input", device=self.device)
        cuda._check(output, "output", (input.dtype,), device=self.device)
        if output.numel() != input.numel() or input.numel() % self.world_size:
            raise ValueError(
                f"all_to_all needs input and output of one size, a multiple of world_size "
                f"{self.world_size}; got {input.numel()} and {output.numel()} elements"
            )
        output.view(-1).copy_(input.view(-1))
        with self._lock:  # the transport's counts follow the order of calls
            self.all_to_all_on(output.view(-1), torch.cuda.current_stream(self.device))
        return output

    # Sends and receives.

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> "DeviceWork":
        """`tensor` to rank `dst`, whose k-th recv from this rank takes this rank's k-th send
        to it (the same count, dtype and tag, else every rank raises MismatchError over
        cuda_ipc). Enqueued after the work on the current stream; over cuda_ipc on the sends'
        stream, so that a send that waits for its receive (one of more than two slices) holds
        back neither the collectives nor the receives, but does hold back later sends; over nccl
        on the communicator's own stream, in call order, where sends that wait for receives
        posted after them on the other side wait for ever, as NCCL's own ungrouped sends do. The
        DeviceWork's wait() makes the current stream wait for it."""
        return self._message(tensor, dst, True, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> "DeviceWork":
        """Rank `src`'s matching send into `tensor`, as send() is enqueued."""
        return self._message(tensor, src, False, tag)

    def _message(self, tensor: torch.Tensor, peer: int, send: bool, tag: int) -> "DeviceWork":
        caller = torch.cuda.current_stream(self.device)
        with self._lock:
            stream = self.message_after(caller, tensor, peer, send, tag)
            return self._finish(caller, stream, tensor, True)

    def enqueue_message(self, tensor, peer: int, send: bool, tag: int = 0) -> torch.cuda.Stream:
        """send() or recv() without a DeviceWork: returns the stream it is enqueued on (the
        torch backend makes its own Work)."""
        caller = torch.cuda.current_stream(self.device)
        with self._lock:
            return self.message_after(caller, tensor, peer, send, tag)

    def exchange_on(
        self, source, flat, sends: Sequence[tuple], recvs: Sequence[tuple], kind: str, root, count
    ) -> None:
        """Inside run_after's body: the exchange of `kind` ("scatter", "gather", "all_to_all",
        with its root, -1 for none, and count): `sends`, (peer, offset, count) in elements of
        `source`, and `recvs`, into `flat`, at most one of each per peer, in rank order; the send
        to a peer pairs with its receive from this rank, of the same count (to itself: a copy)."""
        cuda._check(source, "source", device=self.device)
        cuda._check(flat, "flat", (source.dtype,), device=self.device)
        for what, tensor, parts in (("source", source, sends), ("flat", flat, recvs)):
            if any(o < 0 or n < 0 or o + n > tensor.numel() for _, o, n in parts):
                raise ValueError(f"an exchange's parts overrun its {what} of {tensor.numel()}")
        self._comm.exchange(
            source.data_ptr(),
            flat.data_ptr(),
            [(int(q), int(o), int(n)) for q, o, n in sends],
            [(int(q), int(o), int(n)) for q, o, n in recvs],
            TORCH_DTYPES[source.dtype],
            kind,
            int(root),
            int(count),
            self._stream.cuda_stream,
        )

    def message_after(self, caller, tensor, peer: int, send: bool, tag: int = 0):
        """Under self._lock (send(), recv(), enqueue_message()): the send of `tensor` to `peer`
        (`send`) or its receive from it after the work on `caller`, on the sends' or the
        receives' stream (cuda_ipc), or on this communicator's own stream in call order (nccl: its
        operations on one communicator must not run on several streams at once); `tensor` held
        until that stream is past it. Returns the stream."""
        cuda._check(tensor, "tensor", device=self.device)
        if not tensor.is_contiguous():
            raise ValueError("send and recv take contiguous tensors")
        peer = int(peer)
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"rank {self.rank} of {self.world_size} cannot "
                f"{'send to' if send else 'receive from'} rank {peer}"
            )
        if self.transport == "nccl":
            stream = self._own_after(caller)
        else:
            stream = self._message_streams.get(send)
            if stream is None:
                stream = self._message_streams[send] = self._new_stream()
            ready = torch.cuda.Event()
            ready.record(caller)
            stream.wait_event(ready)
        (self._comm.send if send else self._comm.recv)(
            tensor.data_ptr(),
            tensor.numel(),
            TORCH_DTYPES[tensor.dtype],
            peer,
            int(tag) & 0xFFFFFFFF,
            stream.cuda_stream,
        )
        tensor.record_stream(stream)
        return stream

    def all_reduce_on(self, tensor: torch.Tensor, op="sum") -> None:
        """Inside run_after's body: the all-reduce of `tensor` in place."""
        self._enqueue(tensor, op, "auto", self._stream)

    def sparse_all_reduce_work(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        counts: Sequence[int],
        out: torch.Tensor,
        op="sum",
        async_op: bool = True,
    ) -> Optional["DeviceWork"]:
        """Communicator.sparse_all_reduce on the device: every rank's (int32 indices, values)
        pairs, counts[r] of them from rank r, gathered over this communicator's transport, then
        added rank by rank into `out` (zeroed first) by ringcomm's scatter-add kernel, in the same
        order on every rank (indices distinct within a rank, as top-k gives them); "avg" divides
        by the ranks. Stream semantics, Work and future as all_reduce_work's. An index outside
        `out` is skipped and sets a flag that raise_bad_index() (Communicator.sparse_all_reduce's
        next call, synchronize()) raises as ProtocolError: checking it at once would block the
        host."""
        if op not in ("sum", "avg"):
            raise ValueError(f"sparse_all_reduce sums or averages, got op {op!r}")
        cuda._check(indices, "indices", (torch.int32,), device=self.device)
        cuda._check(values, "values", cuda.TOPK_DTYPES, device=self.device)
        cuda._check(out, "out", cuda.TOPK_DTYPES, device=self.device)
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size or counts[self.rank] != indices.numel():
            raise ValueError(
                f"counts {counts} must give each of the {self.world_size} ranks' pairs, this "
                f"rank's {indices.numel()}"
            )
        if values.numel() != indices.numel():
            raise ValueError(f"{indices.numel()} indices but {values.numel()} values")
        starts = [sum(counts[:r]) for r in range(self.world_size)]
        total = sum(counts)
        caller = torch.cuda.current_stream(self.device)
        with self._lock:
            own = self._own_after(caller)
            if self._bad is None:
                self._bad = torch.zeros(1, dtype=torch.int32, device=self.device)
                self._bad_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                self._bad_copied = torch.cuda.Event()
            with torch.cuda.stream(own):  # what is allocated here belongs to `own`
                all_indices = torch.empty(total, dtype=torch.int32, device=self.device)
                all_values = torch.empty(total, dtype=values.dtype, device=self.device)
                mine = slice(starts[self.rank], starts[self.rank] + counts[self.rank])
                all_indices[mine].copy_(indices.view(-1))
                all_values[mine].copy_(values.view(-1))
                if total:  # the same on every rank: the counts are agreed
                    for gathered in (all_indices, all_values):
                        self._comm.all_gather(
                            gathered.data_ptr(),
                            counts,
                            TORCH_DTYPES[gathered.dtype],
                            own.cuda_stream,
                        )
                dense = out.view(-1)
                dense.zero_()
                for r in range(self.world_size):
                    part = slice(starts[r], starts[r] + counts[r])
                    cuda.scatter_add_(
                        dense,
                        all_indices[part],
                        all_values[part].to(out.dtype),
                        check=False,
                        bad=self._bad,
                    )
                if op == "avg":
                    dense.div_(self.world_size)
                self._bad_host.copy_(self._bad, non_blocking=True)
                self._bad_copied.record(own)
            for t in (indices, values, out):
                t.record_stream(own)
            return self._finish(caller, own, out, async_op)

    def _new_stream(self) -> torch.cuda.Stream:
        """A stream no other code of the process enqueues on (torch.cuda.Stream() hands out
        pooled streams, which another of this path's streams, or the caller's, may share)."""
        module = cuda._load()[0]
        return torch.cuda.ExternalStream(module.new_stream(self.device.index), device=self.device)

    def _own_after(self, caller: torch.cuda.Stream) -> torch.cuda.Stream:
        """This communicator's own stream, made to wait for the work on `caller`. Under
        self._lock."""
        if self._stream is None:
            self._stream = self._new_stream()
            self._ready, self._done = torch.cuda.Event(), torch.cuda.Event()
        # One event each way, reused: a stream's wait takes the event as recorded then.
        self._ready.record(caller)
        self._stream.wait_event(self._ready)
        return self._stream

    def _enqueue_after(self, caller: torch.cuda.Stream, tensors, op, algorithm: str):
        """Enqueues the all_reduces on this communicator's own stream after the work on
        `caller`, each tensor held until that stream is past it; returns the stream. Under
        self._lock."""
        for tensor in tensors:
            cuda._check(tensor, "tensor", device=self.device)
        own = self._own_after(caller)
        for tensor in tensors:
            self._enqueue(tensor, op, algorithm, own)
            tensor.record_stream(own)
        return own

    def _finish(self, caller, own, result: torch.Tensor, async_op: bool):
        """The end of an operation enqueued on `own`: a DeviceWork holding `result`, or None
        with `caller` made to wait for it. Under self._lock."""
        done = torch.cuda.Event() if async_op else self._done
        done.record(own)
        if not async_op:
            caller.wait_event(done)
            return None
        future = torch.futures.Future(devices=[self.device])
        with torch.cuda.stream(own):
            future.set_result(result)  # its event: recorded on `own`, right after `done`
        return DeviceWork(self, result, done, future, own)

    def bad_index_seen(self) -> bool:
        """Whether an earlier sparse_all_reduce met an index outside its output, as far as its
        flag has reached the host (no wait). Every rank scatters the same pairs, so every rank's
        flag ends the same; when it is known differs, so callers agree on it before raising."""
        return self._bad is not None and self._bad_copied.query() and bool(self._bad_host.item())

    def raise_bad_index(self) -> None:
        """Waits for the flag of the sparse_all_reduces so far and, where it is set, clears it
        and raises ProtocolError."""
        with self._lock:
            if self._bad is None:
                return
            self._bad_copied.synchronize()
            if not self._bad_host.item():
                return
            self._bad_host.zero_()
            with torch.cuda.stream(self._stream):  # after the scatter-adds that set it
                self._bad.zero_()
        raise _C.ProtocolError(
            f"rank {self.rank}: a sparse_all_reduce on {self.device} received an index outside "
            f"its output; the pairs holding it were skipped"
        )

    def synchronize(self, timeout: Optional[timedelta] = None) -> None:
        """Waits for the work on the current stream. A failed peer, an abort or the deadline
        (default: the communicator's timeout) raises RingcommError (its subclass for the kind)."""
        timeout = self.timeout if timeout is None else timeout
        self._comm.synchronize(
            torch.cuda.current_stream(self.device).cuda_stream, timeout.total_seconds()
        )
        self.raise_bad_index()

    def close(self) -> None:
        """Releases the transport; every rank calls it once its work is done (cuda_ipc waits
        until every rank has, within the timeout). The work on all_reduce_work's stream is
        and the sends' and receives' streams are waited for first."""
        try:
            # a failure raises after the release: close() then frees
            for stream in [self._stream, *self._message_streams.values()]:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self.synchronize()
        finally:
            self._comm.close()

    def abort(self) -> None:
        """Gives up at once: waits on peers are released, every later call raises, and the
        peers raise too (cuda_ipc, nccl)."""
        self._comm.abort()


class DeviceWork:
    """The Work of DeviceCommunicator.all_reduce_work, send and recv, as ProcessGroupNCCL's: for
    the host the operation is done once enqueued; the device is done when its stream is past it.

    wait() makes the current stream wait for it, without blocking the host; wait(timeout)
    also blocks the host until the operation's stream is done, raising RingcommError if a
    peer failed or the timeout passed. get_future() is a CUDA-aware torch Future holding the
    tensor: waiting on it, or on what it chains, makes the current stream wait. A peer's failure
    raises at the communicator's next call, as its module says."""

    def __init__(
        self,
        comm: DeviceCommunicator,
        tensor: torch.Tensor,
        done: torch.cuda.Event,
        future: torch.futures.Future,
        stream: torch.cuda.Stream,
    ):
        self._comm, self._tensor, self._done, self._future = comm, tensor, done, future
        self._stream = stream

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            if not isinstance(timeout, timedelta):
                timeout = timedelta(seconds=timeout)
            with torch.cuda.stream(self._stream):
                self._comm.synchronize(timeout)
        torch.cuda.current_stream(self._comm.device).wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        """Whether the device is past the operation."""
        return self._done.query()

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        """None: a failure is raised by the communicator's next call, or by wait(timeout)."""
        return None

    def result(self) -> torch.Tensor:
        self.wait()
        return self._tensor

    def source(self) -> int:
        return -1

    def stats(self) -> dict:
        """Work.stats()'s keys, each 0: the device transports move the bytes without the host,
        which neither counts nor times them."""
        return dict.fromkeys(("bytes_sent", "bytes_received", "queued_s", "run_s", "idle_s"), 0)

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _on_finish(self, fn) -> None:
        """As Work._on_finish: fn() runs at once, the host's part being done."""
        fn()


class DevicePaths:
    """The DeviceCommunicators of one group of ranks, one per CUDA device, each joined at the
    first all_reduce of a tensor on its device, which every rank issues at the same point of the
    group's common order: get() is then a collective. A device where no transport serves every
    rank (or where `transports` is empty, or there is no `store`) gets None: its CUDA tensors are
    staged through host memory, which is logged at INFO once, with the reason (`off`, when
    given, says why there is no device path at all)."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        transports: Sequence[str] = TRANSPORTS,
        off: str = "",
    ):
        self._store, self._transports, self._off = store, tuple(transports), off
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._paths = {}  # CUDA device index -> DeviceCommunicator, None where staged
        self._lock = threading.Lock()

    def get(self, where: torch.device) -> Optional[DeviceCommunicator]:
        with self._lock:
            if where.index in self._paths:
                return self._paths[where.index]
            path, why = None, self._off
            if not why and self._store is None:
                why = "no store to join a device path through"
            elif not why and not self._transports:
                why = "device_transports=() turns the device path off"
            elif not why:
                try:
                    path = DeviceCommunicator(
                        self._store,
                        self.rank,
                        self.world_size,
                        where,
                        self.timeout,
                        self._transports,
                        name=f"device{len(self._paths)}",
                    )
                except NoDeviceTransport as e:
                    why = str(e)
            if path is None:
                logger.info(
                    "ringcomm: rank %d of %d stages CUDA tensors on %s through host memory: %s",
                    self.rank,
                    self.world_size,
                    where,
                    why,
                )
            self._paths[where.index] = path
            return path

    def joined_on(self, where: torch.device) -> Optional[DeviceCommunicator]:
        """The device path of `where` if a collective has joined it, else None; never joins
        (for sends and receives, which not every rank takes part in)."""
        with self._lock:
            return self._paths.get(where.index)

    def transports(self) -> dict:
        """{"cuda:<i>": "cuda_ipc" | "nccl" | "host"} for each device met so far."""
        with self._lock:
            paths = dict(self._paths)
        return {f"cuda:{i}": "host" if p is None else p.transport for i, p in sorted(paths.items())}

    def joined(self) -> list:
        with self._lock:
            return [p for p in self._paths.values() if p is not None]

    def close(self) -> None:
        """Closes every device path (each waits for its stream's work, and for its peers)."""
        with contextlib.ExitStack() as closing:  # each runs, the last first, whatever raises
            for path in self.joined():
                closing.callback(path.close)

    def abort(self) -> None:
        # Without the lock, which a join in progress holds: abort() may come from a signal
        # handler on the joining thread.
        for path in list(self._paths.values()):
            if path is not None:
                path.abort()
