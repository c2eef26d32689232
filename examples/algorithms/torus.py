"""A 2-D torus all-reduce, which none of the built-ins is: the ranks as a grid of rows x columns
(rank = row * columns + column; with one host per row, a row is the ranks of one host). Half of
the buffer is reduce-scattered along the rows and then along the columns, the other half along
the columns and then along the rows, each by a ring; the completed pieces are gathered back in
the reverse order. The two halves run side by side, so the links of both dimensions carry data at
once, where the hierarchical all-reduce (rows, then columns, then rows) uses one dimension at a
time.

Per rank, each half moves the ring's bytes: 2(c-1)/c of it along its row and 2(r-1)/r of a c-th
of it along its column, or the other way round."""

from itertools import zip_longest
from math import isqrt

from ringcomm.algorithms import Program, register


def reduce_scatter(p, group, me, segments):
    """A ring reduce-scatter among the ranks of `group` (this rank at index `me`) of `segments`
    (lists of blocks): segment k ends complete at group[k]."""
    m = len(group)
    if m == 1:
        return
    prev, nxt = group[(me - 1) % m], group[(me + 1) % m]
    for b in segments[(me - 1) % m]:
        p.send(b, dst=nxt)
    for s in range(m - 2):
        for b in segments[(me - s - 2) % m]:
            p.recv_reduce_send(b, src=prev, dst=nxt)
    for b in segments[me]:
        p.recv_reduce(b, src=prev)


def all_gather(p, group, me, segments):
    """A ring all-gather among `group` of the segments reduce_scatter completed."""
    m = len(group)
    if m == 1:
        return
    prev, nxt = group[(me - 1) % m], group[(me + 1) % m]
    for b in segments[me]:
        p.send(b, dst=nxt)
    for s in range(m - 2):
        for b in segments[(me - s - 1) % m]:
            p.recv_send(b, src=prev, dst=nxt)
    for b in segments[(me + 1) % m]:
        p.recv(b, src=prev)


def torus(columns):
    """The algorithm for grids of `columns` ranks per row."""

    def program(rank, n):
        if n % columns:
            raise ValueError(f"{n} ranks are not rows of {columns}")
        rows = n // columns
        row, col = divmod(rank, columns)
        row_ranks = [row * columns + j for j in range(columns)]
        col_ranks = [i * columns + col for i in range(rows)]
        # Half 0 (blocks 0 .. n-1): row segment j (blocks j*rows ..), cut along the column into
        # rows blocks. Half 1 (blocks n .. 2n-1): column segment i, cut along the row.
        by_row = [[j * rows + i for i in range(rows)] for j in range(columns)]
        by_col = [[n + i * columns + j for j in range(columns)] for i in range(rows)]
        phases = [  # (half 0's phase, half 1's phase), run interleaved
            (
                lambda q: reduce_scatter(q, row_ranks, col, by_row),
                lambda q: reduce_scatter(q, col_ranks, row, by_col),
            ),
            (
                lambda q: reduce_scatter(q, col_ranks, row, [[b] for b in by_row[col]]),
                lambda q: reduce_scatter(q, row_ranks, col, [[b] for b in by_col[row]]),
            ),
            (
                lambda q: all_gather(q, col_ranks, row, [[b] for b in by_row[col]]),
                lambda q: all_gather(q, row_ranks, col, [[b] for b in by_col[row]]),
            ),
            (
                lambda q: all_gather(q, row_ranks, col, by_row),
                lambda q: all_gather(q, col_ranks, row, by_col),
            ),
        ]
        p = Program(blocks=2 * n)
        for first, second in phases:
            a, b = Program(blocks=2 * n), Program(blocks=2 * n)
            first(a)
            second(b)
            p.steps += [s for pair in zip_longest(a.steps, b.steps) for s in pair if s]
        return p

    program.__name__ = f"torus_{columns}_columns"
    return program


def square_columns(n):
    """The largest divisor of n that is at most its square root: 2 for 4 ranks, 2 for 8."""
    return next(c for c in range(isqrt(n), 0, -1) if n % c == 0)


register("torus", lambda rank, n: torus(square_columns(n))(rank, n))
