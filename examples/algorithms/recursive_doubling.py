"""The recursive doubling all-reduce (csrc/algorithms/recursive_doubling.cc) as a Python program:
with p the largest power of two <= n, the first 2(n - p) ranks fold in pairs into the odd one,
the p that remain exchange the whole buffer with the partner across each bit of their index,
and the folded ranks get the result back. Both partners of an exchange combine the lower index's
value first, so every rank ends with the same bits."""

from ringcomm.algorithms import Program, register


def recursive_doubling(rank, n):
    p = Program(blocks=1, slice_bytes=0)  # the whole buffer, one message per exchange
    butterfly = 1 << (n.bit_length() - 1)
    rem = n - butterfly
    if rank < 2 * rem and rank % 2 == 0:  # folded away: hand over, get the result back
        p.send(0, dst=rank + 1)
        p.recv(0, src=rank + 1)
        return p
    if rank < 2 * rem:
        p.recv_reduce(0, src=rank - 1, incoming_first=True)  # the lower rank's data first
    index = rank // 2 if rank < 2 * rem else rank - rem
    mask = 1
    while mask < butterfly:
        partner = index ^ mask
        p.exchange_reduce(
            0, 2 * partner + 1 if partner < rem else partner + rem, incoming_first=partner < index
        )
        mask *= 2
    if rank < 2 * rem:
        p.send(0, dst=rank - 1)
    return p


register("py_recursive_doubling", recursive_doubling)
