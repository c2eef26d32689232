"""The algorithms' step lists (csrc/algorithms/schedule.h) and the reduction orders derived from
them by running every rank's list symbolically. The expected orders are written out here from
each algorithm's description, independently of the step lists; tests/test_fusion.py checks
that the derived orders are the ones the algorithms execute, bit for bit."""

import pytest

from ringcomm import _C
from ringcomm._buffers import ALGORITHMS


def ring_order(ranks, k):
    # Segment k starts at index k+1 and travels around; each rank combines mine (op) incoming.
    m = len(ranks)
    acc = str(ranks[(k + 1) % m])
    for j in range(2, m + 1):
        acc = f"({ranks[(k + j) % m]} {acc})"
    return acc


def tree_order(n, mirrored):
    # Heap tree (the mirror maps position p to rank n-1-p); at each node (mine op child0) op child1.
    def node(pos):
        acc = str(n - 1 - pos if mirrored else pos)
        for child in (2 * pos + 1, 2 * pos + 2):
            if child < n:
                acc = f"({acc} {node(child)})"
        return acc

    return node(0)


def butterfly(n):
    """p, the largest power of two <= n, and the value butterfly index i starts with: the first
    2 (n - p) ranks folded in pairs (lower rank's op higher's), the others as they are."""
    p = 1
    while p * 2 <= n:
        p *= 2
    rem = n - p
    return p, lambda i: f"({2 * i} {2 * i + 1})" if i < rem else str(i + rem)


def recursive_doubling_order(n):
    p, leaf = butterfly(n)

    def span(lo, length):
        if length == 1:
            return leaf(lo)
        return f"({span(lo, length // 2)} {span(lo + length // 2, length // 2)})"

    return span(0, p)


def halving_doubling_order(n):
    # Each block ends at one butterfly index, combined across the highest index bit first (the
    # first halving), each pair (lower index's op higher's); the folded pairs as in recursive
    # doubling. Every block the same.
    p, leaf = butterfly(n)

    def value(i, mask):  # index i's value of its block once the halvings down to `mask` ran
        if mask == p:
            return leaf(i)
        return f"({value(i & ~mask, 2 * mask)} {value(i | mask, 2 * mask)})"

    return [value(k, 1) for k in range(p)]


def runs(blocks, count):
    """(elements, order) runs of a buffer of `count` elements cut evenly into len(blocks) blocks
    with those orders: the blocks that follow one in the same order join it, as the orders
    reduce them in one pass."""
    out = []
    for order in blocks:
        if out and out[-1][1] == order:
            out[-1] = (out[-1][0] + count // len(blocks), order)
        else:
            out.append((count // len(blocks), order))
    return out


def orders(algorithm, n, count, hosts=()):
    return [tuple(r) for r in _C.reduction_orders(ALGORITHMS[algorithm], n, count, list(hosts))]


@pytest.mark.parametrize("n", list(range(2, 18)) + [31, 64])
def test_orders_derived_from_step_lists(n):
    count = 128 * n  # every algorithm's blocks of one size
    ring = [ring_order(list(range(n)), k) for k in range(n)]
    assert orders("ring", n, count) == runs(ring, count)
    assert orders("tree", n, count) == runs([tree_order(n, False), tree_order(n, True)], count)
    assert orders("recursive_doubling", n, count) == runs([recursive_doubling_order(n)], count)
    assert orders("halving_doubling", n, count) == runs(halving_doubling_order(n), count)
    # the shared buffer: not a step list; every element in rank order, left to right
    left_to_right = "0"
    for r in range(1, n):
        left_to_right = f"({left_to_right} {r})"
    assert orders("shared_buffer", n, count) == [(count, left_to_right)]


def test_blocks_in_one_order_join():
    # Two ranks: halving-doubling's two blocks are both (0 1), the ring's (0 1) and (1 0).
    assert orders("halving_doubling", 2, 10) == [(10, "(0 1)")]
    assert orders("ring", 2, 10) == [(5, "(0 1)"), (5, "(1 0)")]


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 2), (2, 3), (4, 4)])
def test_hierarchical_order(hosts, per_host):
    layout = [[h * per_host + j for j in range(per_host)] for h in range(hosts)]
    count = 64 * hosts * per_host
    got = orders("hierarchical", hosts * per_host, count, layout)
    # Host segment j summed in ring order over each host's ranks, then piece h of it in ring order
    # over the hosts' sums.
    want = []
    for j in range(per_host):
        sums = [ring_order(host, j) for host in layout]
        want += [ring_order(sums, h) for h in range(hosts)]
    assert got == runs(want, count)


def test_ring_step_list_reads_as_documented():
    # ring.cc's header, rank 0 of 4: reduce-scatter then all-gather.
    assert _C.schedule(ALGORITHMS["ring"], 4, 0) == (
        "send b3 >1; recv-reduce-send b2 <3 >1; recv-reduce-send b1 <3 >1; "
        "recv-reduce-send b0 <3 >1 (complete); recv-send b3 <3 >1; recv-send b2 <3 >1; recv b1 <3"
    )


def test_tree_and_recursive_doubling_step_lists():
    # Rank 1 of 4: in the heap tree the parent of 3 and child of 0, a leaf of the mirror (under 3).
    assert _C.schedule(ALGORITHMS["tree"], 4, 1) == (
        "recv-reduce-send b0 <3 >0; send b1 >3; recv b0 <0 (lag 1); send b0 >3 (lag 1); "
        "recv b1 <3 (lag 1)"
    )
    # Rank 4 of 6 (p = 4, rem = 2: ranks 0-3 fold into 1 and 3; 4 is butterfly index 2).
    assert _C.schedule(ALGORITHMS["recursive_doubling"], 6, 4) == (
        "exchange-reduce b0 <>5; exchange-reduce b0 <>1 (incoming first) (complete)"
    )
    assert _C.schedule(ALGORITHMS["recursive_doubling"], 6, 0) == "send b0 >1; recv b0 <1"


def test_halving_doubling_step_lists():
    # Rank 0 of 4: halves with index 2 (keeps b0 b1), then with 1 (keeps b0, complete); gathers
    # from 1, then from 2.
    assert _C.schedule(ALGORITHMS["halving_doubling"], 4, 0) == (
        "send b2 >2; send b3 >2; recv-reduce b0 <2; recv-reduce b1 <2; send b1 >1; "
        "recv-reduce b0 <1 (complete); send b0 >1; recv b1 <1; send b0 >2; send b1 >2; "
        "recv b2 <2; recv b3 <2"
    )
    # Rank 3 of 6 (p = 4, rem = 2: ranks 0-3 fold into 1 and 3; 3 is butterfly index 1).
    assert _C.schedule(ALGORITHMS["halving_doubling"], 6, 3) == (
        "recv-reduce b0 <2 (incoming first); recv-reduce b1 <2 (incoming first); "
        "recv-reduce b2 <2 (incoming first); recv-reduce b3 <2 (incoming first); "
        "send b2 >5; send b3 >5; recv-reduce b0 <5; recv-reduce b1 <5; "
        "send b0 >1; recv-reduce b1 <1 (incoming first) (complete); "
        "send b1 >1; recv b0 <1; send b0 >5; send b1 >5; recv b2 <5; recv b3 <5; "
        "send b0 >2; send b1 >2; send b2 >2; send b3 >2"
    )
    assert _C.schedule(ALGORITHMS["halving_doubling"], 6, 2) == (
        "send b0 >3; send b1 >3; send b2 >3; send b3 >3; recv b0 <3; recv b1 <3; recv b2 <3; "
        "recv b3 <3"
    )


def test_no_step_list_for_other_algorithms():
    with pytest.raises(ValueError, match="no step list"):
        _C.schedule(ALGORITHMS["hierarchical"], 4, 0)


def run_stream_groups(groups_of_rank):
    """Runs every rank's groups (stream_plan.h) as a CUDA stream would with NCCL: a rank's
    current group completes once every message in it has met its peer's matching message, posted
    in the peer's current or an already completed group (no message is assumed to go out before
    its peer posts the other side). Returns the number of groups that completed."""
    n = len(groups_of_rank)
    posts = {}  # (sender, receiver, "send" or "recv") -> [(group, first, count)] in order
    for r, groups in enumerate(groups_of_rank):
        for g, (messages, _) in enumerate(groups):
            for kind, peer, first, count in messages:
                link = (r, peer) if kind == "send" else (peer, r)
                posts.setdefault(link + (kind,), []).append((g, first, count))
    needs = [[[] for _ in groups] for groups in groups_of_rank]  # (peer, its group) per group
    for (src, dst, kind), sends in posts.items():
        if kind != "send":
            continue
        recvs = posts.get((src, dst, "recv"), [])
        assert len(sends) == len(recvs), f"{src}->{dst}: {len(sends)} sends, {len(recvs)} receives"
        for (gs, first_s, count_s), (gr, first_r, count_r) in zip(sends, recvs):
            assert (first_s, count_s) == (first_r, count_r), f"{src}->{dst} messages differ"
            needs[src][gs].append((dst, gr))
            needs[dst][gr].append((src, gs))
    assert all(k == "send" or (s, d, "send") in posts for s, d, k in posts)
    current = [0] * n
    progress = True
    while progress:
        progress = False
        for r in range(n):
            while current[r] < len(groups_of_rank[r]) and all(
                current[peer] >= g for peer, g in needs[r][current[r]]
            ):
                current[r] += 1
                progress = True
    stuck = [r for r in range(n) if current[r] < len(groups_of_rank[r])]
    assert not stuck, f"deadlock: ranks {stuck} at groups {[current[r] for r in stuck]}"
    return sum(current)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_doubling"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("count,slice", [(1, 1), (100, 7), (1000, 1000), (37, 3)])
def test_stream_groups_complete(algorithm, n, count, slice):
    code = ALGORITHMS[algorithm]
    groups = [_C.stream_groups(code, n, r, count, slice) for r in range(n)]
    assert run_stream_groups(groups) > 0
    # No rank can know the sum of an element without receiving something of it.
    for r in range(n):
        received = set()
        for messages, _ in groups[r]:
            for kind, _, first, cnt in messages:
                if kind == "recv":
                    received.update(range(first, first + cnt))
        assert received == set(range(count))


def test_halving_doubling_has_no_stream_groups():
    # Rank 0 of 4 sends b2 and b3 to rank 2 and then receives b0 and b1 from it, one step each:
    # its first group (b2, b3 out, b0 in) needs rank 2's second (b3 in), and rank 2's first needs
    # rank 0's second. The device executor refuses the algorithm over messages (device/executor.cc).
    code = ALGORITHMS["halving_doubling"]
    with pytest.raises(AssertionError, match="deadlock"):
        run_stream_groups([_C.stream_groups(code, 4, r, 4, 1) for r in range(4)])


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("count,slice", [(0, 1), (100, 7), (37, 3)])
def test_all_gather_stream_groups_complete(n, count, slice):
    groups = [_C.stream_groups(0, n, r, count, slice, all_gather=True) for r in range(n)]
    assert run_stream_groups(groups) > 0
    blocks = [count // n + (1 if r < count % n else 0) for r in range(n)]
    for r in range(n):
        own = range(sum(blocks[:r]), sum(blocks[: r + 1]))
        received = {
            i
            for messages, reduce in groups[r]
            for kind, _, first, cnt in messages
            if kind == "recv"
            for i in range(first, first + cnt)
        }
        assert not any(reduce for _, reduce in groups[r])
        assert received == set(range(count)) - set(own)


def test_stream_groups_catch_a_deadlock():
    # The check above can fail: a ring whose ranks post their sends alone, each in its own group
    # before the receive, would block every stream on a send.
    n = 3
    groups = [
        [([("send", (r + 1) % n, 0, 1)], False), ([("recv", (r - 1) % n, 0, 1)], True)]
        for r in range(n)
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        run_stream_groups(groups)
