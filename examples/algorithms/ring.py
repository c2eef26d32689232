"""The ring all-reduce (csrc/algorithms/ring.cc) as a Python program: a reduce-scatter, each
segment combined at every rank it passes, then an all-gather of the completed segments. It runs
the same steps over the same blocks and slices as the built-in ring, so its results are the same
bits. RINGCOMM_ALGORITHM_FILE=examples/algorithms/ring.py RINGCOMM_ALGO=py_ring runs it for every
auto all_reduce."""

from ringcomm.algorithms import Program, register


def ring(rank, n):
    p = Program(blocks=n)  # segment k: block k
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    p.send((rank - 1) % n, dst=nxt)  # this rank's own segment r-1 sets off
    for s in range(n - 2):
        p.recv_reduce_send((rank - s - 2) % n, src=prev, dst=nxt)
    p.recv_reduce_send(rank, src=prev, dst=nxt)  # segment r complete: the all-gather starts
    for s in range(n - 2):
        p.recv_send((rank - s - 1) % n, src=prev, dst=nxt)
    p.recv((rank + 1) % n, src=prev)
    return p


register("py_ring", ring)
