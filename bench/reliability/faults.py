#!/usr/bin/env python
"""Fault injection: real ranks, real faults, from outside the library.

Each trial starts N real rank processes (N in 2..5; transport shm, tcp or mixed: shared memory
inside a fake host of two ranks, TCP between hosts), which rendezvous through a FileStore and run
the same random stream of collectives (every op ringcomm has, sizes from 4 bytes to 8 MiB, a
random all_reduce / sparse algorithm, some async pairs). After a random delay the parent injects
one fault into a random victim rank:

  kill       SIGKILL at whatever the victim is doing;
  close_all  the victim shuts down (shutdown(SHUT_RDWR)) every TCP socket it holds, found through
             /proc/self/fd and /proc/net/tcp{,6}: a helper thread in the victim does it when the
             parent says so on a pipe; there is no hook in the library;
  close_one  the same, for one socket only: one of the victim's connections to one peer (the
             parent pairs sockets with peers from /proc/<pid>/fd and /proc/net/tcp);
  stall      SIGSTOP, under a short communicator timeout; SIGKILL once the others are done.

Every rank but the victim must raise the RingcommError of the fault's kind (PeerLostError for a
kill or a close, CollectiveTimeoutError for a stall) naming the victim ("rank V"), kill/close
within about a second (detection = its raise time - the fault time, time.time() on one host),
stall within about a second past the timeout (reported as the excess over the timeout). No
process may still be alive `timeout + grace` seconds after the fault (a hang: it is killed and
its last op reported); afterwards no process of the trial, no listening port of the ranks and no
new /dev/shm entry may remain.

    .venv/bin/python bench/reliability/faults.py --trials 200 --seed 1 --json faults.json
    .venv/bin/python bench/reliability/faults.py --ci    # the short fixed plan tests/faults runs

Exit status: 1 on a hang, or when detection p99 of the kill/close kinds exceeds --max-p99
(1.5 s); --strict also fails on wrong/unclear errors and leftovers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

from harness import connect, rank_env

CTX = mp.get_context("forkserver")
# As tests/ranks.py: ranks fork from a server that imported these once (a rank starts in ms).
CTX.set_forkserver_preload(["torch", "ringcomm", "numpy"])

KINDS = ("kill", "close_all", "close_one", "stall")
KIND_WEIGHTS = (0.35, 0.2, 0.2, 0.25)
TRANSPORTS = ("shm", "tcp", "mixed")  # harness.rank_env's
DETECT_KINDS = ("kill", "close_all", "close_one")  # the p99 bound applies to these
# What a survivor must raise for each kind (ringcomm._C's classes, docs/reliability.md).
ERROR_CLASS = {
    "kill": "PeerLostError",
    "close_all": "PeerLostError",
    "close_one": "PeerLostError",
    "stall": "CollectiveTimeoutError",
}
GRACE_S = 5.0  # a process alive timeout + GRACE_S after the fault is a hang
SETUP_TIMEOUT_S = 60.0  # all ranks up and connected
STATUS_BYTES = 256

# Element counts (float32) an op's main buffer may have: 4 B .. 8 MiB.
SIZES = (1, 37, 1000, 16384, 65536, 262144, 1 << 20, 2 << 20)
SIZE_WEIGHTS = (1, 1, 1, 1, 1, 2, 2, 1)
OPS = (
    "all_reduce",
    "all_reduce_async",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gatherv",
    "reduce_scatter",
    "barrier",
    "gather",
    "scatter",
    "all_to_all",
    "sparse_all_reduce",
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "all_gather_coalesced",
    "send_recv",
)
OP_WEIGHTS = (6, 2, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1)
ALGORITHMS = ("auto", "ring", "tree", "recursive_doubling", "shared_buffer")
SPARSE_ALGORITHMS = ("auto", "ring", "sparse_gather", "sparse_ranges")


# ---- /proc helpers ---------------------------------------------------------------------------


def tcp_table() -> dict:
    """inode -> (state hex, local "ADDR:PORT" hex, remote) of every TCP socket in this netns."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    inode = int(parts[9])
                    if inode:
                        out[inode] = (parts[3], parts[1], parts[2])
        except OSError:
            pass
    return out


def socket_fds(pid="self") -> dict:
    """fd -> socket inode, for every socket `pid` holds."""
    out = {}
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", link)
        if m:
            out[int(name)] = int(m[1])
    return out


def listening_ports() -> set:
    return {
        int(local.rsplit(":", 1)[1], 16)
        for state, local, _ in tcp_table().values()
        if state == "0A"
    }


def shm_entries() -> set:
    """/dev/shm's entries, less multiprocessing's named semaphores (sem.mp-*): this harness makes
    none (pipes only), but other pytest runs on the machine (tests/ranks.py's queues) do."""
    try:
        return {e for e in os.listdir("/dev/shm") if not e.startswith("sem.mp-")}
    except OSError:
        return set()


def shm_files_of(pid: int) -> set:
    """Files under /dev/shm that `pid` has open or mapped (a memfd has no such name)."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) > 5 else ""
                if path.startswith("/dev/shm/"):
                    out.add(path.removesuffix(" (deleted)"))
    except OSError:
        pass
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if link.startswith("/dev/shm/"):
                out.add(link.removesuffix(" (deleted)"))
    except OSError:
        pass
    return out


def process_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the rank ------------------------------------------------------------------------------


def shutdown_tcp_sockets(inodes=None) -> int:
    """Shuts down (both directions) every TCP socket this process holds, or those of `inodes`:
    through a duplicate of the descriptor, so the library's own descriptor stays open and sees
    the fault as it would see a broken connection."""
    tcp = tcp_table()
    n = 0
    for fd, inode in socket_fds().items():
        if inode not in tcp or (inodes is not None and inode not in inodes):
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()
    return n


def runnable(comm, algo: str) -> str:
    """`algo`, or auto for shared_buffer where some rank is not in shared memory (the same on
    every rank: with the transport mixed none has every peer there, with tcp none has any)."""
    if algo == "shared_buffer" and any(t not in ("shm", "self") for t in comm.transports):
        return "auto"
    return algo


def make_op(rng: random.Random, world: int):
    """One random op, drawn the same on every rank (same rng state): (description, callable
    taking (comm, rank))."""
    import torch

    name = rng.choices(OPS, OP_WEIGHTS)[0]
    n = rng.choices(SIZES, SIZE_WEIGHTS)[0]
    per = max(1, n // world)
    root = rng.randrange(world)
    f32 = torch.float32

    if name == "all_reduce":
        algo, op = rng.choice(ALGORITHMS), rng.choice(("sum", "max", "avg"))
        desc = f"all_reduce(n={n}, op={op}, algorithm={algo})"

        def run(comm, rank):
            comm.all_reduce(torch.empty(n, dtype=f32), op=op, algorithm=runnable(comm, algo))
    elif name == "all_reduce_async":
        algo, m = rng.choice(ALGORITHMS), rng.choice(SIZES[:6])
        desc = f"async all_reduce(n={n}, algorithm={algo}) + broadcast(n={m}, src={root})"

        def run(comm, rank):
            a, b = torch.empty(n, dtype=f32), torch.empty(m, dtype=f32)
            w1 = comm.all_reduce(a, algorithm=runnable(comm, algo), async_op=True)
            w2 = comm.broadcast(b, root, async_op=True)
            w1.wait()
            w2.wait()
    elif name == "broadcast":
        desc = f"broadcast(n={n}, src={root})"

        def run(comm, rank):
            comm.broadcast(torch.empty(n, dtype=f32), root)
    elif name == "reduce":
        desc = f"reduce(n={n}, dst={root})"

        def run(comm, rank):
            comm.reduce(torch.empty(n, dtype=f32), root)
    elif name == "all_gather":
        desc = f"all_gather(n={per}x{world})"

        def run(comm, rank):
            comm.all_gather(torch.empty(per * world, dtype=f32), torch.empty(per, dtype=f32))
    elif name == "all_gatherv":
        counts = [rng.randint(0, per) for _ in range(world)]
        desc = f"all_gatherv(counts={counts})"

        def run(comm, rank):
            comm.all_gatherv(
                torch.empty(sum(counts), dtype=f32), torch.empty(counts[rank], dtype=f32), counts
            )
    elif name == "reduce_scatter":
        desc = f"reduce_scatter(n={per}x{world})"

        def run(comm, rank):
            comm.reduce_scatter(torch.empty(per, dtype=f32), torch.empty(per * world, dtype=f32))
    elif name == "barrier":
        desc = "barrier()"

        def run(comm, rank):
            comm.barrier()
    elif name == "gather":
        desc = f"gather(n={per}, dst={root})"

        def run(comm, rank):
            outs = [torch.empty(per, dtype=f32) for _ in range(world)] if rank == root else None
            comm.gather(torch.empty(per, dtype=f32), outs, root)
    elif name == "scatter":
        desc = f"scatter(n={per}, src={root})"

        def run(comm, rank):
            ins = [torch.empty(per, dtype=f32) for _ in range(world)] if rank == root else None
            comm.scatter(ins, torch.empty(per, dtype=f32), root)
    elif name == "all_to_all":
        desc = f"all_to_all(n={per}x{world})"

        def run(comm, rank):
            comm.all_to_all(
                [torch.empty(per, dtype=f32) for _ in range(world)],
                [torch.empty(per, dtype=f32) for _ in range(world)],
            )
    elif name == "sparse_all_reduce":
        algo = rng.choice(SPARSE_ALGORITHMS)
        numel = max(n, 16)
        k = max(1, numel // rng.choice((4, 30, 300)))
        desc = f"sparse_all_reduce(numel={numel}, k={k}, algorithm={algo})"

        def run(comm, rank):
            g = torch.Generator().manual_seed(rank)
            idx = torch.randint(0, numel, (k,), dtype=torch.int32, generator=g)
            comm.sparse_all_reduce(idx, torch.ones(k), numel, algorithm=algo)
    elif name in ("all_reduce_coalesced", "broadcast_coalesced", "all_gather_coalesced"):
        parts = rng.randint(1, 6)
        sizes = [max(1, int(n * rng.random() / parts)) for _ in range(parts)]
        bucket = rng.choice((1 << 16, 1 << 20, 25 << 20))
        if name == "broadcast_coalesced":
            desc = f"broadcast_coalesced(sizes={sizes}, src={root}, bucket_bytes={bucket})"
        else:
            desc = f"{name}(sizes={sizes}, bucket_bytes={bucket})"

        def run(comm, rank):
            ts = [torch.empty(s, dtype=f32) for s in sizes]
            if name == "all_reduce_coalesced":
                comm.all_reduce_coalesced(ts, bucket_bytes=bucket)
            elif name == "broadcast_coalesced":
                comm.broadcast_coalesced(ts, root, bucket_bytes=bucket)
            else:
                outs = [[torch.empty(s, dtype=f32) for s in sizes] for _ in range(world)]
                comm.all_gather_coalesced(outs, ts, bucket_bytes=bucket)
    else:  # send_recv: a ring shift
        desc = f"send_recv(n={n}, ring shift)"

        def run(comm, rank):
            w = comm.isend(torch.empty(n, dtype=f32), (rank + 1) % world)
            comm.recv(torch.empty(n, dtype=f32), (rank - 1) % world)
            w.wait()

    return desc, run


def rank_main(spec: dict, rank: int, path: str, status_path: str, conn):
    """One rank: connect, say "ready", then run the trial's op stream until something raises;
    report the raise (time, type, text, op), close the communicator, report that, exit."""
    send_lock = threading.Lock()

    def report(*msg):
        with send_lock:
            try:
                conn.send(msg)
            except OSError:
                pass

    status = os.open(status_path, os.O_WRONLY | os.O_CREAT, 0o600)

    def set_status(text):
        os.pwrite(status, text.encode()[:STATUS_BYTES].ljust(STATUS_BYTES), 0)

    try:
        set_status("connecting")
        os.environ.update(spec["env"][rank])
        import torch.distributed as dist

        import ringcomm

        store, comm = connect(path, rank, spec["world"], spec["timeout"], "faults")
        addr = dist.PrefixStore("ringcomm/faults", store).get(f"addr/{rank}").decode()
    except BaseException as e:  # noqa: BLE001
        report("setup_error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        os._exit(3)

    injecting, injected = threading.Event(), threading.Event()

    def listen_for_fault():
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "shutdown":
            injecting.set()
            t0 = time.time()
            n = shutdown_tcp_sockets(msg[1])
            report("shutdown_done", rank, t0, time.time(), n)
            injected.set()

    threading.Thread(target=listen_for_fault, daemon=True).start()
    report("ready", rank, os.getpid(), addr, comm.transports)

    rng = random.Random(spec["op_seed"])
    i, desc = 0, "none"
    try:
        while True:
            desc, run = make_op(rng, spec["world"])
            set_status(f"op {i}: {desc}")
            run(comm, rank)
            i += 1
    except BaseException as e:  # noqa: BLE001
        t = time.time()
        report(
            "error",
            rank,
            t,
            f"{type(e).__module__}.{type(e).__qualname__}",
            isinstance(e, ringcomm.RingcommError),
            str(e),
            i,
            desc,
        )
    set_status(f"closing after op {i}: {desc}")
    start = time.monotonic()
    try:
        comm.close()
        closed = "ok"
    except BaseException as e:  # noqa: BLE001
        closed = f"{type(e).__name__}: {e}"
    report("closed", rank, time.monotonic() - start, closed)
    set_status(f"exiting after op {i}: {desc}")
    if injecting.is_set():  # this rank is the victim: its report of the shutdown first
        injected.wait(5)
    os._exit(0)


# ---- the trial -----------------------------------------------------------------------------


def peer_sockets(pids: dict, victim: int) -> dict:
    """peer rank -> inodes of the victim's TCP sockets connected to that peer."""
    tcp = tcp_table()
    local_of = {}  # local endpoint -> rank
    for r, pid in pids.items():
        if r == victim:
            continue
        for inode in socket_fds(pid).values():
            if inode in tcp:
                local_of[tcp[inode][1]] = r
    out = {}
    for inode in socket_fds(pids[victim]).values():
        if inode in tcp and tcp[inode][2] in local_of:
            out.setdefault(local_of[tcp[inode][2]], []).append(inode)
    return out


def names_rank(text: str, rank: int) -> bool:
    """Whether an error text names `rank`: "rank 3", "peer 3", "rank(s) 1, 3"."""
    if re.search(rf"\b(?:rank|peer) {rank}\b", text):
        return True
    return any(str(rank) in re.findall(r"\d+", m) for m in re.findall(r"rank\(s\) ([\d, ]+)", text))


def run_trial(spec: dict) -> dict:
    world, victim, kind = spec["world"], spec["victim"], spec["kind"]
    tmp = tempfile.mkdtemp(prefix="ringcomm-faults-")
    shm_before, listen_before = shm_entries(), listening_ports()
    status_paths = [os.path.join(tmp, f"status.{r}") for r in range(world)]
    pipes = [CTX.Pipe() for _ in range(world)]
    procs = [
        CTX.Process(
            target=rank_main, args=(spec, r, tmp, status_paths[r], pipes[r][1]), daemon=True
        )
        for r in range(world)
    ]
    rec = dict(spec, survivors=[], hangs=[], leftovers={}, victim_report=None, notes=[])
    started = time.monotonic()
    for p in procs:
        p.start()
    for _, child_end in pipes:
        child_end.close()
    conns = {pipes[r][0]: r for r in range(world)}
    ready, errors, closed, shutdown_done, setup_errors = {}, {}, {}, None, {}
    open_conns = set(conns)

    def status_of(r):
        try:
            with open(status_paths[r], "rb") as f:
                return f.read(STATUS_BYTES).decode(errors="replace").strip()
        except OSError:
            return "?"

    def pump(until, stop):
        """Reads reports until `stop()` or the monotonic time `until`."""
        nonlocal shutdown_done
        while not stop():
            left = until - time.monotonic()
            if left <= 0:
                return False
            waitables = list(open_conns) + [p.sentinel for p in procs if p.exitcode is None]
            for obj in mpc.wait(waitables, timeout=min(left, 0.1)):
                if obj not in conns:
                    continue
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    open_conns.discard(obj)
                    continue
                tag, r = msg[0], msg[1]
                if tag == "ready":
                    ready[r] = msg[2:]
                elif tag == "error":
                    errors[r] = msg[2:]
                elif tag == "closed":
                    closed[r] = msg[2:]
                elif tag == "shutdown_done":
                    shutdown_done = msg[2:]
                elif tag == "setup_error":
                    setup_errors[r] = msg[2]
        return True

    t_fault = None
    shm_used = set()
    try:
        ok = pump(
            time.monotonic() + SETUP_TIMEOUT_S,
            lambda: (
                len(ready) == world or setup_errors or any(p.exitcode is not None for p in procs)
            ),
        )
        rec["setup_s"] = round(time.monotonic() - started, 3)
        if len(ready) < world:
            rec["setup_failed"] = (
                f"{len(ready)}/{world} ranks ready; errors: {setup_errors}; "
                f"exit codes {[p.exitcode for p in procs]}" + ("" if ok else " (setup timed out)")
            )
            return rec
        pids = {r: ready[r][0] for r in range(world)}
        rec["transports"] = ready[0][2]
        ports = sorted(
            {
                int(ready[r][1].split("tcp=", 1)[1].split(";")[0].rsplit(":", 1)[1])
                for r in range(world)
            }
        )
        rec["ports"] = ports
        still_listening = sorted(set(ports) & listening_ports())
        if still_listening:
            rec["notes"].append(
                f"listening ports {still_listening} still open after the mesh was complete"
            )

        pump(time.monotonic() + spec["delay"], lambda: bool(errors))
        if errors:  # before any fault: a bug in the library or the harness
            rec["early_errors"] = {r: errors[r][3] for r in errors}

        vpid = pids[victim]
        target = None
        if kind == "close_one":
            by_peer = peer_sockets(pids, victim)
            if spec["peer"] not in by_peer:
                rec["notes"].append(
                    f"no socket found from rank {victim} to rank {spec['peer']}: "
                    f"{ {p: len(v) for p, v in by_peer.items()} }"
                )
            socks = by_peer.get(spec["peer"], [])
            target = [random.Random(spec["op_seed"]).choice(socks)] if socks else []
            rec["sockets_to_peer"] = len(socks)
        rec["op_at_fault"] = status_of(victim)
        shm_used = set().union(*(shm_files_of(pid) for pid in pids.values()))
        t_fault = time.time()
        if kind == "kill":
            os.kill(vpid, signal.SIGKILL)
        elif kind == "stall":
            os.kill(vpid, signal.SIGSTOP)
        else:
            pipes[victim][0].send(("shutdown", target))
        rec["t_fault"] = t_fault
        deadline = time.monotonic() + spec["timeout"] + GRACE_S
        survivors = [r for r in range(world) if r != victim]

        def settled():
            done = all(procs[r].exitcode is not None for r in survivors)
            if kind in ("close_all", "close_one"):
                done = done and procs[victim].exitcode is not None
            return done

        pump(deadline, settled)
        if kind == "stall":
            try:
                os.kill(vpid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Exit codes and the last reports of ranks that just exited.
        pump(time.monotonic() + 0.5, lambda: not open_conns)

        for r in range(world):
            alive = procs[r].exitcode is None and process_alive(procs[r].pid)
            if alive and not (r == victim and kind == "stall"):
                state = (
                    "closing"
                    if r in errors and r not in closed
                    else "exiting"
                    if r in closed
                    else "running"
                )
                rec["hangs"].append(
                    {
                        "rank": r,
                        "state": state,
                        "last_op": status_of(r),
                        "raised": errors[r][3] if r in errors else None,
                    }
                )
        for r in survivors:
            s = {"rank": r, "exitcode": procs[r].exitcode, "last_op": status_of(r)}
            if r in errors:
                t, etype, is_rc, text, op_index, op = errors[r]
                s.update(
                    error_type=etype,
                    ringcomm_error=is_rc,
                    text=text,
                    op=op,
                    detect_s=round(t - t_fault, 4),
                    named=(
                        etype == f"ringcomm._C.{ERROR_CLASS[kind]}" and names_rank(text, victim)
                    ),
                )
                if t < t_fault:
                    s["outcome"] = "early"
                elif s["named"]:
                    s["outcome"] = "named"
                else:
                    s["outcome"] = "wrong"
            elif any(h["rank"] == r for h in rec["hangs"]):
                s["outcome"] = "hang"
            else:
                s["outcome"] = "no_report"  # died without raising: a crash
            if r in closed:
                s["close_s"] = round(closed[r][0], 4)
                if closed[r][1] != "ok":
                    s["close_error"] = closed[r][1]
            rec["survivors"].append(s)
        if victim in errors:
            t, etype, is_rc, text, op_index, op = errors[victim]
            rec["victim_report"] = {
                "error_type": etype,
                "text": text,
                "op": op,
                "after_s": round(t - t_fault, 4),
            }
        if shutdown_done:
            rec["shutdown"] = {
                "after_s": round(shutdown_done[0] - t_fault, 4),
                "took_s": round(shutdown_done[1] - shutdown_done[0], 4),
                "sockets": shutdown_done[2],
            }
    finally:
        for p in procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)  # stopped or hung: SIGKILL works on both
                except ProcessLookupError:
                    pass
        for p in procs:
            p.join(timeout=5)
        for parent_end, _ in pipes:
            parent_end.close()
        rec["duration_s"] = round(time.monotonic() - started, 3)
        # Leftovers: processes, the ranks' listening ports, /dev/shm entries.
        alive = [p.pid for p in procs if process_alive(p.pid)]
        if alive:
            rec["leftovers"]["processes"] = alive
        ports = set(rec.get("ports", ()))
        if ports:
            listening = sorted((listening_ports() - listen_before) & ports)
            if listening:
                rec["leftovers"]["listening_ports"] = listening
        # New entries, and any the ranks had open or mapped that are still there.
        still = {p for p in shm_used if os.path.exists(p)}
        new_shm = sorted((shm_entries() - shm_before) | {os.path.basename(p) for p in still})
        if new_shm:
            rec["leftovers"]["dev_shm"] = new_shm
        shutil.rmtree(tmp, ignore_errors=True)
    return rec


# ---- plans ---------------------------------------------------------------------------------


def make_spec(
    index: int,
    rng: random.Random,
    kind: str,
    transport: str,
    world: int,
    timeout: float,
    stall_timeout: float,
    max_delay: float,
) -> dict:
    victim = rng.randrange(world)
    peer = rng.choice([r for r in range(world) if r != victim])
    sockets = rng.choice((1, 1, 2)) if transport != "shm" else 1
    env = [
        dict(rank_env(transport, r, world), RINGCOMM_SOCKETS_PER_PEER=str(sockets))
        for r in range(world)
    ]
    return {
        "index": index,
        "kind": kind,
        "transport": transport,
        "world": world,
        "victim": victim,
        "peer": peer if kind == "close_one" else None,
        "delay": round(rng.uniform(0.05, max_delay), 3),
        "timeout": stall_timeout if kind == "stall" else timeout,
        "sockets_per_peer": sockets,
        "op_seed": rng.getrandbits(32),
        "env": env,
    }


def random_plan(
    trials: int, seed: int, kinds, transports, worlds, timeout, stall_timeout, max_delay
) -> list:
    rng = random.Random(seed)
    weights = [KIND_WEIGHTS[KINDS.index(k)] for k in kinds]
    plan = []
    for i in range(trials):
        kind = rng.choices(kinds, weights)[0]
        transport = rng.choice(transports)
        # mixed needs two fake hosts: at least 3 ranks
        world = rng.choice([w for w in worlds if transport != "mixed" or w >= 3] or worlds)
        plan.append(make_spec(i, rng, kind, transport, world, timeout, stall_timeout, max_delay))
    return plan


# The short fixed selection tests/faults runs: each kind x transport once, world sizes 2-4.
CI_PLAN = [
    ("kill", "shm", 2),
    ("kill", "tcp", 3),
    ("kill", "mixed", 4),
    ("close_all", "shm", 3),
    ("close_all", "tcp", 2),
    ("close_all", "mixed", 3),
    ("close_one", "shm", 4),
    ("close_one", "tcp", 3),
    ("close_one", "mixed", 4),
    ("stall", "shm", 2),
    ("stall", "tcp", 3),
    ("stall", "mixed", 3),
]


def ci_plan(seed: int, timeout: float, stall_timeout: float) -> list:
    rng = random.Random(seed)
    return [
        make_spec(i, rng, k, t, w, timeout, stall_timeout, 0.5)
        for i, (k, t, w) in enumerate(CI_PLAN)
    ]


# ---- report --------------------------------------------------------------------------------


def percentile(values, q):
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(-(-q * len(v) // 100)) - 1))]


def summarize(trials: list) -> dict:
    groups = {}
    for t in trials:
        for key in ((t["kind"], t["transport"]), (t["kind"], "all")):
            groups.setdefault(key, []).append(t)
    out = {}
    for (kind, transport), ts in sorted(
        groups.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1] == "all", kv[0][1])
    ):
        surv = [s for t in ts for s in t["survivors"]]
        det = [
            s["detect_s"] - (t["timeout"] if kind == "stall" else 0)
            for t in ts
            for s in t["survivors"]
            if s.get("outcome") in ("named", "wrong")
        ]
        out[f"{kind}/{transport}"] = {
            "kind": kind,
            "transport": transport,
            "trials": len(ts),
            "setup_failed": sum("setup_failed" in t for t in ts),
            "survivors": len(surv),
            "named": sum(s["outcome"] == "named" for s in surv),
            "wrong": sum(s["outcome"] in ("wrong", "early", "no_report") for s in surv),
            "hangs": sum(len(t["hangs"]) for t in ts),
            "hung_trials": sum(bool(t["hangs"]) for t in ts),
            "leftovers": sum(bool(t["leftovers"]) for t in ts),
            "p50_s": percentile(det, 50),
            "p99_s": percentile(det, 99),
            "max_s": max(det) if det else None,
        }
    return out


def fmt_s(v):
    return "-" if v is None else f"{v * 1000:.0f}"


def print_table(summary: dict, file=sys.stdout):
    head = (
        f"{'kind':<10} {'transport':<9} {'trials':>6} {'surv':>5} {'named':>5} {'wrong':>5} "
        f"{'hangs':>5} {'left':>4} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for g in summary.values():
        print(
            f"{g['kind']:<10} {g['transport']:<9} {g['trials']:>6} {g['survivors']:>5} "
            f"{g['named']:>5} {g['wrong']:>5} {g['hangs']:>5} {g['leftovers']:>4} "
            f"{fmt_s(g['p50_s']):>7} {fmt_s(g['p99_s']):>7} {fmt_s(g['max_s']):>7}",
            file=file,
        )
    print(
        "(stall: times are past the communicator timeout; surv = ranks other than the victim; "
        "wrong = raised without naming the victim, or not the fault's RingcommError class, or "
        "crashed)",
        file=file,
    )


def trial_line(t: dict) -> str:
    head = (
        f"#{t['index']:<3} {t['kind']:<9} {t['transport']:<5} n={t['world']} "
        f"victim={t['victim']}" + (f" peer={t['peer']}" if t["peer"] is not None else "")
    )
    if "setup_failed" in t:
        return f"{head}  SETUP FAILED: {t['setup_failed'][:300]}"
    det = [s.get("detect_s") for s in t["survivors"]]
    outs = ",".join(s["outcome"] for s in t["survivors"])
    line = (
        f"{head}  {outs}  detect={[None if d is None else round(d, 3) for d in det]}  "
        f"({t['duration_s']:.1f}s)  at: {t.get('op_at_fault', '?')[:70]}"
    )
    if t["hangs"]:
        line += f"  HANG {t['hangs']}"
    if t["leftovers"]:
        line += f"  LEFTOVERS {t['leftovers']}"
    if t.get("early_errors"):
        line += f"  EARLY {t['early_errors']}"
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every trial and the summary here")
    ap.add_argument("--ci", action="store_true", help="the short fixed plan (12 trials) instead")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--worlds", default="2,3,4,5")
    ap.add_argument("--timeout", type=float, default=10.0, help="communicator timeout, kill/close")
    ap.add_argument("--stall-timeout", type=float, default=2.0, help="communicator timeout, stall")
    ap.add_argument("--max-delay", type=float, default=1.2, help="latest fault, s after setup")
    ap.add_argument("--max-p99", type=float, default=1.5, help="detection bound, kill/close (s)")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="also fail on wrong/unclear errors, crashes and leftovers",
    )
    ap.add_argument(
        "--only",
        help="run only these trials of the plan (indices, comma-separated): "
        "to reproduce one, give the same plan options and --seed",
    )
    ap.add_argument("-q", "--quiet", action="store_true", help="no line per trial")
    args = ap.parse_args(argv)

    if args.ci:
        plan = ci_plan(args.seed, args.timeout, args.stall_timeout)
    else:
        plan = random_plan(
            args.trials,
            args.seed,
            args.kinds.split(","),
            args.transports.split(","),
            [int(w) for w in args.worlds.split(",")],
            args.timeout,
            args.stall_timeout,
            args.max_delay,
        )
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        plan = [spec for spec in plan if spec["index"] in keep]
    trials = []
    start = time.monotonic()
    for spec in plan:
        t = run_trial(spec)
        t.pop("env", None)
        trials.append(t)
        if not args.quiet:
            print(trial_line(t), flush=True)
    wall = time.monotonic() - start
    summary = summarize(trials)
    print()
    print_table(summary)
    hangs = sum(len(t["hangs"]) for t in trials)
    det = [
        s["detect_s"]
        for t in trials
        if t["kind"] in DETECT_KINDS
        for s in t["survivors"]
        if s.get("outcome") in ("named", "wrong")
    ]
    p99 = percentile(det, 99)
    wrong = sum(s["outcome"] != "named" for t in trials for s in t["survivors"])
    leftovers = sum(bool(t["leftovers"]) for t in trials)
    setup_failed = sum("setup_failed" in t for t in trials)
    print(
        f"\n{len(trials)} trials in {wall:.0f} s; hangs {hangs}; kill/close detection "
        f"p50 {fmt_s(percentile(det, 50))} ms, p99 {fmt_s(p99)} ms over {len(det)} survivors; "
        f"wrong/unclear {wrong}; trials with leftovers {leftovers}; setup failures {setup_failed}"
    )
    unclear = [(t, s) for t in trials for s in t["survivors"] if s["outcome"] != "named"]
    if unclear:
        print(f"\nsurvivors whose error does not name the victim ({len(unclear)}; first 5):")
        for t, s in unclear[:5]:
            print(
                f"  #{t['index']} {t['kind']} {t['transport']} n={t['world']} victim={t['victim']} "
                f"rank {s['rank']} ({s['outcome']}): {s.get('text', s.get('last_op', ''))[:200]}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "wall_s": wall, "summary": summary, "trials": trials},
                f,
                indent=1,
            )
    failed = hangs > 0 or (p99 is not None and p99 > args.max_p99) or setup_failed > 0
    if args.strict:
        failed = failed or wrong > 0 or leftovers > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
