"""Collectives written in Python (ringcomm.algorithms): the examples' step lists against the
built-ins', the check refusing broken lists (a kept set of mutants) with the rank, step and block
at fault, and registered algorithms run by the core over every transport: the Python ring bit for
bit the built-in ring, the algorithm that ran in the reports, ranks with different lists failing
as a mismatch, RINGCOMM_ALGO and RINGCOMM_ALGORITHM_FILE."""

import inspect
import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from ringcomm import _C, algorithms
from ringcomm._buffers import ALGORITHMS
from ringcomm.algorithms import Program
from ranks import run_ranks

# The tests that run collectives do so over every transport; those that check lists alone, or
# start their own processes, run once (transport_fixed).
pytestmark = pytest.mark.every_transport
EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "algorithms"
)


def example(name):
    """The example file's namespace (running it registers its algorithm)."""
    return runpy.run_path(os.path.join(EXAMPLES, f"{name}.py"))


RING = example("ring")["ring"]
DOUBLE_TREE = example("double_tree")["double_tree"]
RECURSIVE_DOUBLING = example("recursive_doubling")["recursive_doubling"]
TORUS = example("torus")["torus"]


@pytest.mark.transport_fixed
@pytest.mark.parametrize(
    "algorithm,built_in,sizes",
    [
        (RING, "ring", range(2, 13)),
        (DOUBLE_TREE, "tree", range(2, 13)),
        (RECURSIVE_DOUBLING, "recursive_doubling", range(2, 13)),
    ],
)
def test_examples_are_the_built_in_step_lists(algorithm, built_in, sizes):
    # Steps, blocks, peers, operand order and the completing steps the check marks.
    for n, report in algorithms.check(algorithm, sizes).items():
        assert report["steps"] == [_C.schedule(ALGORITHMS[built_in], n, r) for r in range(n)]


@pytest.mark.transport_fixed
def test_the_ring_is_short_and_its_orders_are_the_built_in_ones():
    source = inspect.getsource(RING).strip().splitlines()
    assert len(source) <= 15
    report = algorithms.check(RING, [4])[4]
    # Segment k starts at rank k+1 and each rank combines mine (op) incoming.
    assert report["orders"] == ["(0 (3 (2 1)))", "(1 (0 (3 2)))", "(2 (1 (0 3)))", "(3 (2 (1 0)))"]
    assert report["orders"] == [
        order for count, order in _C.reduction_orders(ALGORITHMS["ring"], 4, 4)
    ]


@pytest.mark.transport_fixed
def test_the_torus_checks_on_its_grids():
    reports = algorithms.check(TORUS(2), [2, 4, 6, 8])
    # 2 x 2: half 0 along the rows first, half 1 along the columns first.
    assert reports[4]["orders"][0] == "((0 1) (2 3))"
    assert reports[4]["orders"][4] == "((0 2) (1 3))"
    algorithms.check(TORUS(3), [3, 9, 12])
    with pytest.raises(
        ValueError, match="rank 0's program raised ValueError: 5 ranks are not rows of 2"
    ):
        algorithms.check(TORUS(2), [5])


# -- the check refuses ------------------------------------------------------------------------


def mutant(base, victims, change):
    """`base` with `change(steps)` applied to the steps of rank `victims` (a rank, a tuple of
    ranks, or None for every rank)."""

    def program(rank, n):
        p = base(rank, n)
        if victims is None or rank == victims or (isinstance(victims, tuple) and rank in victims):
            change(p.steps)
        return p

    program.__name__ = base.__name__
    return program


PRIM = _C.PRIMITIVE_CODES


def delete(i):
    return lambda steps: steps.pop(i)


def duplicate(i):
    return lambda steps: steps.insert(i, steps[i])


def move(i, j):
    return lambda steps: steps.insert(j, steps.pop(i))


def swap(i, j):
    def change(steps):
        steps[i], steps[j] = steps[j], steps[i]

    return change


def receives_first(k):
    """The first k steps moved after the next k."""

    def change(steps):
        steps[: 2 * k] = steps[k : 2 * k] + steps[:k]

    return change


def set_field(i, field, value):
    fields = ("prim", "block", "src", "dst", "incoming_first", "lag")

    def change(steps):
        step = list(steps[i])
        step[fields.index(field)] = PRIM[value] if field == "prim" else value
        steps[i] = tuple(step)

    return change


def flip_order(i):
    def change(steps):
        step = list(steps[i])
        step[4] = not step[4]
        steps[i] = tuple(step)

    return change


# (kind, base, world size, victims, change). Ring rank r of 4:
# send b(r-1); recv-reduce-send b(r-2), b(r-3); recv-reduce-send b(r) (complete); recv-send
# b(r-1), b(r-2); recv b(r+1). Tree of 5 (by slice): the reduce phase, then the broadcast phase
# a slice behind. Recursive doubling of 4: two exchanges; of 6: ranks 0 and 2 fold into 1 and 3.
MUTANTS = [
    ("dropped send", RING, 4, 0, delete(0)),
    ("dropped send", RING, 4, 2, delete(0)),
    ("dropped send", RING, 4, 1, set_field(4, "prim", "recv")),
    ("dropped send", RING, 3, 1, set_field(1, "prim", "recv_reduce")),
    ("dropped send", DOUBLE_TREE, 5, 3, delete(0)),
    ("dropped send", DOUBLE_TREE, 5, 0, delete(4)),
    ("dropped send", RECURSIVE_DOUBLING, 6, 0, delete(0)),
    ("dropped send", RECURSIVE_DOUBLING, 6, 3, delete(3)),
    ("swapped peer", RING, 4, 0, set_field(0, "dst", 2)),
    ("swapped peer", RING, 4, 1, set_field(1, "src", 3)),
    ("swapped peer", RING, 4, 2, set_field(6, "src", 3)),
    ("swapped peer", DOUBLE_TREE, 5, 1, set_field(2, "dst", 4)),
    ("swapped peer", DOUBLE_TREE, 5, 4, set_field(0, "dst", 0)),
    ("swapped peer", RECURSIVE_DOUBLING, 4, 0, set_field(0, "dst", 2)),
    ("swapped peer", RECURSIVE_DOUBLING, 4, 3, set_field(1, "dst", 0)),
    ("swapped peer", TORUS(2), 4, 0, set_field(0, "dst", 3)),
    ("duplicated reduce", RING, 4, 0, duplicate(1)),
    ("duplicated reduce", RING, 4, 1, set_field(6, "prim", "recv_reduce")),
    ("duplicated reduce", RING, 4, 3, set_field(4, "prim", "recv_reduce_send")),
    ("duplicated reduce", DOUBLE_TREE, 5, 0, duplicate(0)),
    ("duplicated reduce", DOUBLE_TREE, 5, 2, set_field(2, "prim", "recv_reduce")),
    ("duplicated reduce", RECURSIVE_DOUBLING, 4, 2, duplicate(1)),
    ("duplicated reduce", RECURSIVE_DOUBLING, 6, 0, set_field(1, "prim", "recv_reduce")),
    ("duplicated reduce", TORUS(2), 4, 1, set_field(22, "prim", "recv_reduce")),
    ("missing receive", RING, 4, 0, delete(6)),
    ("missing receive", RING, 4, 2, delete(5)),
    ("missing receive", DOUBLE_TREE, 5, 1, delete(3)),
    ("missing receive", DOUBLE_TREE, 5, 3, delete(3)),
    ("missing receive", RECURSIVE_DOUBLING, 6, 2, delete(1)),
    ("missing receive", TORUS(2), 4, 3, delete(23)),
    ("reorder that deadlocks", RING, 4, None, swap(0, 1)),
    ("reorder that deadlocks", RING, 3, None, move(0, 3)),
    ("reorder that deadlocks", DOUBLE_TREE, 5, 1, set_field(3, "lag", 0)),  # only by slice
    ("reorder that deadlocks", RECURSIVE_DOUBLING, 4, (0, 3), swap(0, 1)),
    ("reorder that deadlocks", RECURSIVE_DOUBLING, 6, 0, swap(0, 1)),
    ("reorder that deadlocks", TORUS(2), 4, None, receives_first(4)),
    ("order differing across ranks", RECURSIVE_DOUBLING, 4, 0, flip_order(0)),
    ("order differing across ranks", RECURSIVE_DOUBLING, 4, 3, flip_order(1)),
    ("order differing across ranks", RECURSIVE_DOUBLING, 6, 4, flip_order(0)),
    ("order differing across ranks", RECURSIVE_DOUBLING, 8, 5, flip_order(2)),
    ("order differing across ranks", RECURSIVE_DOUBLING, 8, 2, flip_order(1)),
]


@pytest.mark.transport_fixed
def test_the_mutant_set_covers_every_kind():
    kinds = {kind for kind, *_ in MUTANTS}
    assert len(MUTANTS) >= 30 and len({base for _, base, *_ in MUTANTS}) >= 3
    assert kinds == {
        "dropped send",
        "swapped peer",
        "duplicated reduce",
        "missing receive",
        "reorder that deadlocks",
        "order differing across ranks",
    }


@pytest.mark.transport_fixed
@pytest.mark.parametrize(
    "kind,base,n,victim,change",
    MUTANTS,
    ids=[f"{m[0]}-{m[1].__name__}{m[2]}-{i}" for i, m in enumerate(MUTANTS)],
)
def test_mutants_are_refused_naming_rank_and_step(kind, base, n, victim, change):
    algorithms.check(base, [n])  # sound before the change
    with pytest.raises(ValueError) as refused:
        algorithms.check(mutant(base, victim, change), [n])
    message = str(refused.value)
    assert re.search(r"rank \d+ step \d+ \(", message), message
    assert f"over {n} ranks" in message
    if kind == "order differing across ranks":
        assert "combined in different orders" in message
    if kind == "reorder that deadlocks":
        assert message.endswith("a deadlock"), message


def program_of(steps, blocks=1, **kwargs):
    """An algorithm whose rank r runs steps[r] (lists of (method, args...))."""

    def program(rank, n):
        p = Program(blocks=blocks, **kwargs)
        for method, *args in steps[rank]:
            getattr(p, method)(*args)
        return p

    return program


@pytest.mark.transport_fixed
@pytest.mark.parametrize(
    "steps,blocks,kwargs,message",
    [
        (
            [[("send", 0, 1)], [("recv", 0, 0)]],
            1,
            {},
            r"rank 0 ends with block 0 missing the contribution of rank 1 \(nothing received into "
            r"it: 0\)",
        ),
        (
            [[("recv", 0, 1), ("send", 0, 1)], [("recv", 0, 0), ("send", 0, 0)]],
            1,
            {},
            r"rank 0 step 0 \(recv b0 <1\): waits forever for a message from rank 1, which at step 0 "
            r"\(recv b0 <0\) waits for a message from rank 0: a deadlock",
        ),
        (
            [[("send", 2, 1)], [("recv", 0, 0)]],
            2,
            {},
            r"rank 0 step 0 \(send b2 >1\): names block 2; the buffer has 2 \(0 \.\. 1\)",
        ),
        ([[("send", 0, 0)], []], 1, {}, r"rank 0 step 0 \(send b0 >0\): sends to its own rank"),
        (
            [[("send", 0, 1)], [("recv_reduce", 1, 0)]],
            2,
            {},
            r"rank 1 step 0 \(recv-reduce b1 <0\): receives block 0 from rank 0 \(its step 0 \(send "
            r"b0 >1\)\), not block 1",
        ),
        (
            [
                [("send", 0, 1), ("recv", 0, 1)],
                [("recv_reduce", 0, 0), ("send", 0, 0), ("send", 0, 0)],
            ],
            1,
            {},
            r"rank 1 step 2 \(send b0 >0\): sends block 0 to rank 0, which never receives it",
        ),
        # Rank 0 combines rank 2's block into its own while rank 1 may still be reading its send of
        # it (by single copy, out of rank 0's memory): rank 2 sent without hearing from rank 1.
        (
            [
                [("send", 0, 1), ("recv_reduce", 0, 2), ("recv", 0, 1)],
                [("recv_reduce", 0, 0), ("recv_reduce", 0, 2), ("send", 0, 0), ("send", 0, 2)],
                [("send", 0, 0), ("send", 0, 1), ("recv", 0, 1)],
            ],
            1,
            {},
            r"rank 0 step 1 \(recv-reduce b0 <2\): writes block 0 while rank 1 may still be reading it "
            r"from step 0 \(send b0 >1\)",
        ),
        (
            [[("send", 0, 1)], [("recv_reduce", 0, 0)]],
            2,
            {"collective": "all_gather"},
            r"rank 1 step 0 \(recv-reduce b0 <0\): reduces, but all_gather only moves blocks",
        ),
        (
            [[("send", 0, 1, 1)], [("recv_reduce", 0, 0)]],
            1,
            {},
            r"lag 1 in lists pipelined by step",
        ),
        (
            [[("send", 0, 1)], [("recv", 0, 0)]],
            3,
            {"collective": "reduce_scatter"},
            r"its 3 blocks are not the same number per rank's share",
        ),
    ],
)
def test_refusals_say_what_is_wrong(steps, blocks, kwargs, message):
    with pytest.raises(ValueError, match=message):
        algorithms.check(program_of(steps, blocks, **kwargs), [len(steps)])


@pytest.mark.transport_fixed
def test_programs_of_ranks_must_agree():
    def uneven(rank, n):
        return Program(blocks=n + rank)

    with pytest.raises(ValueError, match="rank 1's program has blocks 3 where rank 0's has 2"):
        algorithms.check(uneven, [2])
    with pytest.raises(ValueError, match="is a list, not a ringcomm.algorithms.Program"):
        algorithms.check(lambda rank, n: [], [2])


@pytest.mark.transport_fixed
def test_registration_checks_its_world_sizes():
    broken = mutant(RING, 0, delete(0))
    with pytest.raises(ValueError, match=r"algorithm 'ring_without_send' \(all_reduce over 2"):
        algorithms.register("ring_without_send", broken, world_sizes=[2, 3])
    assert "ring_without_send" not in algorithms.registered()
    with pytest.raises(ValueError, match="a built-in algorithm's"):
        algorithms.register("ring", RING)
    algorithms.register("ring_again", RING, world_sizes=[2, 3])
    assert algorithms.lists("ring_again", "all_reduce", 3)["steps"][0] == _C.schedule(
        ALGORITHMS["ring"], 3, 0
    )
    with pytest.raises(
        ValueError, match="algorithm 'ring_again' is all_reduce's, not reduce_scatter's"
    ):
        algorithms.lists("ring_again", "reduce_scatter", 3)
    algorithms.unregister("ring_again")
    assert algorithms.lists("ring_again", "all_reduce", 3) is None


# -- registered algorithms run -----------------------------------------------------------------


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def ring_against_built_in(comm, sizes):
    example("ring")
    out = []
    for n in sizes:
        for dtype, op in ((torch.float32, "sum"), (torch.float32, "avg"), (torch.bfloat16, "sum")):
            x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank * 7 + n))
            x = x.to(dtype)
            built_in, python = x.clone(), x.clone()
            comm.all_reduce(built_in, op=op, algorithm="ring")
            work = comm.all_reduce(python, op=op, algorithm="py_ring", async_op=True)
            work.wait()
            out.append(
                (
                    n,
                    str(dtype),
                    op,
                    torch.equal(bits(built_in), bits(python)),
                    work.stats()["algorithm"],
                )
            )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_python_ring_gives_the_built_in_rings_bits(world):
    # Slices of 4 KiB: the larger sizes travel in many slices per segment.
    results = run_ranks(
        world,
        ring_against_built_in,
        [1, 7, 1000, 4099, 100003],
        env={"RINGCOMM_RING_SLICE_BYTES": "4096"},
        timeout=120,
    )
    for rank_results in results:
        for n, dtype, op, equal, ran in rank_results:
            assert equal, (world, n, dtype, op)
            assert ran == "py_ring"


def examples_against_built_ins(comm, count):
    for name in ("double_tree", "recursive_doubling", "torus"):
        example(name)
    x = torch.randn(count, generator=torch.Generator().manual_seed(comm.rank))
    out = {}
    for python, built_in in (
        ("py_double_tree", "tree"),
        ("py_recursive_doubling", "recursive_doubling"),
        ("torus", "ring"),
    ):
        a, b = x.clone(), x.clone()
        comm.all_reduce(a, algorithm=built_in)
        comm.all_reduce(b, algorithm=python)
        out[python] = (torch.equal(a, b), (a - b).abs().max().item(), b)
    return out


def test_other_examples_run_on_four_ranks():
    # An even count: the Python tree's halves are the built-in tree's.
    results = run_ranks(4, examples_against_built_ins, 50002, timeout=120)
    for name in ("py_double_tree", "py_recursive_doubling"):
        assert all(r[name][0] for r in results), name
    # The torus combines in its own order: close to the ring's, the same bits on every rank.
    assert all(r["torus"][1] < 1e-4 for r in results)
    assert all(torch.equal(r["torus"][2], results[0]["torus"][2]) for r in results)


def backwards(rank, n):
    """The ring numbered the other way round: sound, but not the ring."""
    return _reverse(RING, rank, n)


def different_lists(comm):
    # Every rank registers "mine", rank 1 the ring numbered backwards.
    algorithms.register("mine", RING if comm.rank != 1 else backwards)
    t = torch.ones(64)
    try:
        comm.all_reduce(t, algorithm="mine")
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return "ok", t.tolist()


def _reverse(base, rank, n):
    """`base` on a ring numbered the other way round."""
    p = base((n - rank) % n, n)
    flip = lambda r: (n - r) % n if r >= 0 else r  # noqa: E731
    p.steps = [
        (prim, block, flip(src), flip(dst), first, lag)
        for prim, block, src, dst, first, lag in p.steps
    ]
    return p


def test_ranks_with_different_lists_fail_as_a_mismatch():
    # Both lists are sound on their own; together they would combine garbage.
    algorithms.check(backwards, [3])
    results = run_ranks(3, different_lists, allow_errors=True, timeout=60)
    kinds = [r[0] if isinstance(r, tuple) and r[0] != "error" else "error" for r in results]
    assert "ok" not in kinds
    text = " ".join(str(r) for r in results)
    assert "MismatchError" in text or "mismatch" in text.lower()
    assert "algorithm=mine (lists" in text


def built_in_against_registered(comm):
    example("ring")
    t = torch.ones(8)
    try:
        comm.all_reduce(t, algorithm="ring" if comm.rank == 0 else "py_ring")
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__
    return "ok"


def test_a_built_in_against_a_registered_one_is_a_mismatch():
    results = run_ranks(2, built_in_against_registered, allow_errors=True, timeout=60)
    assert all(r == "MismatchError" for r in results), results


def refused_at_first_use(comm):
    algorithms.register("lazy", mutant(RING, 1, delete(0)))  # not checked here: no world sizes
    t = torch.ones(16)
    try:
        comm.all_reduce(t, algorithm="lazy")
        refused = None
    except ValueError as e:
        refused = str(e)
    comm.all_reduce(t, algorithm="ring")  # nothing was sent: the communicator works on
    return refused, t.tolist()


def test_a_list_refused_at_first_use_sends_nothing():
    for refused, values in run_ranks(3, refused_at_first_use, timeout=60):
        assert refused.startswith("algorithm 'lazy' (all_reduce over 3 ranks): rank ")
        assert values == [3.0] * 16


def forced_by_environment(store, rank, world, file, out):
    import ringcomm
    from ringcomm import trace

    os.environ["RINGCOMM_ALGORITHM_FILE"] = file
    os.environ["RINGCOMM_ALGO"] = "py_ring"
    lines = []
    _C.set_log_sink(lines.append)
    comm = ringcomm.Communicator(store, rank, world)
    trace.start(os.path.join(out, f"timeline{rank}.json"))
    work = comm.all_reduce(torch.ones(1000), async_op=True)  # auto: RINGCOMM_ALGO
    work.wait()
    with open(trace.stop()) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "all_reduce"]
    try:
        comm.all_reduce_coalesced([torch.ones(4)])
        coalesced = "ran"
    except ValueError as e:
        coalesced = str(e)
    comm.close()
    _C.set_log_sink(None)
    return work.stats()["algorithm"], [e["args"] for e in events], coalesced, lines


def test_ringcomm_algo_and_algorithm_file(tmp_path):
    results = run_ranks(
        2,
        forced_by_environment,
        os.path.join(EXAMPLES, "ring.py"),
        str(tmp_path),
        make_comm=False,
        env={"RINGCOMM_DEBUG": "1"},
        timeout=60,
    )
    for ran, events, coalesced, lines in results:
        assert ran == "py_ring"
        assert any("py_ring" in str(args) for args in events), events
        assert "RINGCOMM_ALGO=py_ring names a registered one" in coalesced
        assert any("all_reduce by registered algorithm 'py_ring'" in line for line in lines)


def unknown_forced(store, rank, world):
    import ringcomm

    os.environ["RINGCOMM_ALGO"] = "nowhere"
    try:
        ringcomm.Communicator(store, rank, world)
    except ValueError as e:
        return str(e)
    return "made"


@pytest.mark.transport_fixed
def test_ringcomm_algo_names_a_registered_algorithm_or_fails():
    for message in run_ranks(2, unknown_forced, make_comm=False, timeout=60):
        assert message.startswith("RINGCOMM_ALGO=nowhere: expected one of ring, tree, ")
        assert message.endswith("or an algorithm registered by ringcomm.algorithms")


@pytest.mark.transport_fixed
def test_a_broken_algorithm_file_says_so(tmp_path, monkeypatch):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('no such luck')\n")
    monkeypatch.setenv("RINGCOMM_ALGORITHM_FILE", str(path))
    with pytest.raises(
        ValueError, match=f"RINGCOMM_ALGORITHM_FILE={path}: RuntimeError: no such luck"
    ):
        algorithms.registered()


# -- the other collectives -----------------------------------------------------------------------


def ring_reduce_scatter(rank, n):
    """ring.cc's reduce-scatter: segment k ends complete at rank k."""
    p = Program(blocks=n, collective="reduce_scatter")
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    p.send((rank - 1) % n, dst=nxt)
    for s in range(n - 2):
        p.recv_reduce_send((rank - s - 2) % n, src=prev, dst=nxt)
    p.recv_reduce(rank, src=prev)
    return p


def ring_all_gather(rank, n):
    """ring.cc's all-gather, each share in two blocks."""
    p = Program(blocks=2 * n, collective="all_gather")
    prev, nxt = (rank - 1) % n, (rank + 1) % n

    def blocks(share):
        return (2 * (share % n), 2 * (share % n) + 1)

    for b in blocks(rank):
        p.send(b, dst=nxt)
    for s in range(n - 2):
        for b in blocks(rank - s - 1):
            p.recv_send(b, src=prev, dst=nxt)
    for b in blocks(rank + 1):
        p.recv(b, src=prev)
    return p


def chain_broadcast(rank, n):
    """From root 0 down the chain 0 -> 1 -> ... -> n-1, by slice."""
    p = Program(blocks=1, collective="broadcast", pipeline="slice")
    if rank > 0:
        p.recv(0, src=rank - 1)
    if rank < n - 1:
        p.send(0, dst=rank + 1)
    return p


def chain_reduce(rank, n):
    """Up the chain n-1 -> ... -> 0, each rank combining mine (op) its child's, by slice."""
    p = Program(blocks=1, collective="reduce", pipeline="slice")
    if rank == n - 1:
        p.send(0, dst=rank - 1)
    elif rank == 0:
        p.recv_reduce(0, src=1)
    else:
        p.recv_reduce_send(0, src=rank + 1, dst=rank - 1)
    return p


def inputs(rank, count):
    return torch.randn(count, generator=torch.Generator().manual_seed(100 + rank))


def other_collectives(comm, count):
    n, rank = comm.world_size, comm.rank
    algorithms.register("rs", ring_reduce_scatter)
    algorithms.register("ag", ring_all_gather)
    algorithms.register("bc", chain_broadcast)
    algorithms.register("rd", chain_reduce)
    out = {}
    x = torch.cat([inputs(rank, count) for _ in range(n)]) * (rank + 1)
    for op in ("sum", "avg"):
        built_in, python = torch.empty(count), torch.empty(count)
        comm.reduce_scatter(built_in, x, op=op)
        comm.reduce_scatter(python, x, op=op, algorithm="rs")
        out[f"reduce_scatter {op}"] = torch.equal(built_in, python)
    mine = inputs(rank, count)
    gathered = [torch.empty(count) for _ in range(n)]
    work = comm.all_gather(gathered, mine, async_op=True, algorithm="ag")
    work.wait()
    out["all_gather"] = all(torch.equal(gathered[r], inputs(r, count)) for r in range(n))
    out["all_gather algorithm"] = work.stats()["algorithm"]
    root = n - 1
    t = inputs(rank, count) if rank == root else torch.zeros(count)
    comm.broadcast(t, root, algorithm="bc")
    out["broadcast"] = torch.equal(t, inputs(root, count))
    root = 1
    t = inputs(rank, count)
    comm.reduce(t, root, algorithm="rd")
    # The chain from the root: root (op) (root+1 (op) (... )), ranks numbered from the root.
    order = [(root + v) % n for v in range(n)]
    want = inputs(order[-1], count)
    for r in reversed(order[:-1]):
        want = inputs(r, count) + want
    out["reduce"] = torch.equal(t, want) if rank == root else torch.equal(t, inputs(rank, count))
    with pytest.raises(ValueError, match="algorithm 'rs' is reduce_scatter's, not all_reduce's"):
        comm.all_reduce(torch.ones(4), algorithm="rs")
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_other_collectives_by_registered_lists(world):
    # Tree slices of 4 KiB: the chains run pipelined.
    for out in run_ranks(
        world, other_collectives, 10001, env={"RINGCOMM_TREE_CHUNK_BYTES": "4096"}, timeout=120
    ):
        assert out == {
            "reduce_scatter sum": True,
            "reduce_scatter avg": True,
            "all_gather": True,
            "all_gather algorithm": "ag",
            "broadcast": True,
            "reduce": True,
        }


@pytest.mark.transport_fixed
def test_the_other_collectives_check():
    reports = algorithms.check(ring_reduce_scatter, [2, 3, 5])
    assert (
        reports[3]["steps"][0] == "send b2 >1; recv-reduce-send b1 <2 >1; recv-reduce b0 <2 "
        "(complete)"
    )
    assert reports[3]["orders"] == ["(0 (2 1))", "(1 (0 2))", "(2 (1 0))"]
    algorithms.check(ring_all_gather, [2, 3, 5])
    algorithms.check(chain_broadcast, [2, 3, 5])
    assert algorithms.check(chain_reduce, [4])[4]["orders"] == ["(0 (1 (2 3)))"]
    # A broadcast that leaves rank 2 without the root's block.
    with pytest.raises(
        ValueError,
        match=r"rank 2 ends with block 0 holding nothing where rank "
        r"0's belongs \(nothing received into it\)",
    ):
        algorithms.check(mutant(chain_broadcast, (1, 2), lambda steps: steps.pop()), [3])


def backend_forced(store, rank, world, file, out):
    import torch.distributed as dist
    import ringcomm
    from ringcomm import trace

    os.environ["RINGCOMM_ALGORITHM_FILE"] = file
    os.environ["RINGCOMM_ALGO"] = "py_ring"
    dist.init_process_group("ringcomm", store=store, rank=rank, world_size=world)
    trace.start(os.path.join(out, f"backend{rank}.json"))
    t = torch.randn(10001, generator=torch.Generator().manual_seed(rank))
    reference = t.clone()
    dist.all_reduce(t)  # the c10d backend's auto all_reduce: RINGCOMM_ALGO
    ringcomm.communicator_of().all_reduce(reference, algorithm="ring")
    with open(trace.stop()) as f:
        ran = [
            e["args"].get("algorithm")
            for e in json.load(f)["traceEvents"]
            if e.get("name") == "all_reduce"
        ]
    dist.destroy_process_group()
    return ran, torch.equal(t, reference)


def test_the_torch_backend_runs_ringcomm_algo(tmp_path):
    for ran, equal in run_ranks(
        2,
        backend_forced,
        os.path.join(EXAMPLES, "ring.py"),
        str(tmp_path),
        make_comm=False,
        timeout=600,
    ):
        assert ran == ["py_ring", "ring"] and equal


@pytest.mark.transport_fixed
def test_the_bench_runs_a_registered_algorithm_beside_the_built_ins(tmp_path):
    out_file = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "ringcomm.bench",
        "--ranks",
        "4",
        "--sizes",
        "8,64K",
        "-n",
        "2",
        "-w",
        "1",
        "--repeats",
        "1",
        "--algorithm",
        "torus",
        "--algorithm-file",
        os.path.join(EXAMPLES, "torus.py"),
        "--compare",
        "ring",
        "--floor",
        "--json",
        str(out_file),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "algorithm torus" in run.stdout and "ring time ratio" in run.stdout
    for row in json.loads(out_file.read_text())["rows"]:
        assert row["algo"] == "torus"
        assert row["ringcomm"]["wrong"] == 0 and row["ring"]["wrong"] == 0
        assert set(row["ratios"]) == {"ring", "floor"}
    cmd[cmd.index("torus")] = "nowhere"
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "--algorithm nowhere: no algorithm is registered under that name" in run.stderr


def by_size(rank, n, nbytes):
    """Recursive doubling for messages under 4 KiB, the ring from there."""
    return (RECURSIVE_DOUBLING if nbytes < 4096 else RING)(rank, n)


def sized_algorithm(comm):
    algorithms.register("by_size", by_size, world_sizes=[comm.world_size], sizes=[8, 1 << 20])
    out = []
    for count in (100, 1000, 100003):  # 400 B, 4000 B (class 2 KiB), 400012 B
        x = torch.randn(count, generator=torch.Generator().manual_seed(comm.rank))
        a, b = x.clone(), x.clone()
        comm.all_reduce(a, algorithm="recursive_doubling" if count < 1024 else "ring")
        work = comm.all_reduce(b, algorithm="by_size", async_op=True)
        work.wait()
        out.append((torch.equal(a, b), work.stats()["algorithm"]))
    return out


def test_lists_by_size_class():
    reports = algorithms.check(by_size, [3], sizes=[100, 5000])
    assert sorted(reports) == [(3, 64), (3, 4096)]
    assert reports[3, 64]["steps"][0] == _C.schedule(ALGORITHMS["recursive_doubling"], 3, 0)
    assert reports[3, 4096]["steps"][0] == _C.schedule(ALGORITHMS["ring"], 3, 0)
    for out in run_ranks(3, sized_algorithm, timeout=60):
        assert out == [(True, "by_size")] * 3


@pytest.mark.transport_fixed
def test_a_size_class_is_named_where_refused():
    def broken_above_1k(rank, n, nbytes):
        p = RING(rank, n)
        if nbytes >= 1024 and rank == 0:
            del p.steps[0]
        return p

    algorithms.check(broken_above_1k, [3], sizes=[0, 512])
    with pytest.raises(ValueError, match=r"over 3 ranks, messages of 1024\.\.2047 bytes\): rank "):
        algorithms.check(broken_above_1k, [3], sizes=[1500])
