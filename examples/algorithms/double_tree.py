"""The double binary tree all-reduce (csrc/algorithms/tree.cc) as a Python program: two
heap-shaped binary trees, the second the mirror image of the first, each carrying half of the
buffer up (partial sums, children combined in order) and back down, pipelined by slice so that
slice j+1 climbs while slice j descends."""

from ringcomm.algorithms import Program, register


def heap_tree(n, rank, mirrored):
    """(parent or -1, children) of `rank` in the heap tree whose position p has children 2p+1
    and 2p+2; mirrored, position p holds rank n-1-p."""

    def rank_at(pos):
        return n - 1 - pos if mirrored else pos

    pos = n - 1 - rank if mirrored else rank
    parent = rank_at((pos - 1) // 2) if pos > 0 else -1
    return parent, [rank_at(c) for c in (2 * pos + 1, 2 * pos + 2) if c < n]


def double_tree(rank, n):
    p = Program(blocks=2, pipeline="slice")  # half h of the buffer: block h, in tree h
    trees = [heap_tree(n, rank, mirrored) for mirrored in (False, True)]
    for half, (parent, children) in enumerate(trees):  # up: mine (op) child 0 (op) child 1
        if not children:
            p.send(half, dst=parent)
        for i, child in enumerate(children):
            if i == len(children) - 1 and parent >= 0:
                p.recv_reduce_send(half, src=child, dst=parent)
            else:
                p.recv_reduce(half, src=child)
    for half, (parent, children) in enumerate(trees):  # down, a slice behind
        if parent >= 0:
            p.recv(half, src=parent, lag=1)
        for child in children:
            p.send(half, dst=child, lag=1)
    return p


register("py_double_tree", double_tree)
