"""all_reduce on 1-5 real ranks: every op x dtype x algorithm against a float64 reference."""

import hashlib

import numpy as np
import pytest
import torch

from ranks import run_ranks
from ringcomm._buffers import TORCH_DTYPES

pytestmark = pytest.mark.every_transport  # once per transport (conftest.py)

COUNTS = [0, 1, 7, 4097, (1 << 17) + 3]
# Small ring slices and tree chunks, so that the largest count runs the pipelines over many of
# them in every dtype (the defaults need megabytes for that; test_transport_knobs and test_shm
# move those).
PIPELINED = {
    "RINGCOMM_RING_SLICE_BYTES": "16384",
    "RINGCOMM_TREE_CHUNK_BYTES": "8192",
    "RINGCOMM_SHM_BOARD_BYTES": "65536",
}
OPS = ["sum", "avg", "prod", "min", "max"]
ALGOS = ["ring", "tree", "recursive_doubling", "halving_doubling"]


def rank_input(rank, count, dtype, seed=0):
    """Small integers: every reduction of up to 5 of them is exact in every dtype."""
    gen = torch.Generator().manual_seed(1000 * rank + 7 * count + seed)
    low = 0 if dtype in (torch.uint8, torch.bool) else -4
    high = 2 if dtype == torch.bool else 5
    x = torch.randint(low, high, (count,), generator=gen)
    return x.bool() if dtype == torch.bool else x.to(dtype)


def reference(op, world, count, dtype):
    xs = np.stack([rank_input(r, count, dtype).double().numpy() for r in range(world)])
    if dtype == torch.bool:
        xs = xs.astype(bool)
        return {"sum": xs.any(0), "max": xs.any(0), "prod": xs.all(0), "min": xs.all(0)}[op]
    red = {
        "sum": xs.sum(0),
        "avg": xs.mean(0),
        "prod": xs.prod(0),
        "min": xs.min(0),
        "max": xs.max(0),
    }[op]
    if not dtype.is_floating_point:  # integers wrap around, like torch's
        red = (
            red.astype(np.int64)
            .astype(torch.empty(0, dtype=dtype).numpy().dtype)
            .astype(np.float64)
        )
    return red


def tolerance(dtype):
    return {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)


def hierarchical_possible(comm):
    hosts = comm.hosts
    return len(hosts) > 1 and all(len(h) == len(hosts[0]) > 1 for h in hosts)


def shared_buffer_possible(comm):
    """Every rank reaches every other through shared memory (each has a board by default)."""
    return all(t in ("shm", "self") for t in comm.transports)


def algorithms_for(comm):
    """ALGOS, and the shared buffer where every rank is in shared memory."""
    return ALGOS + ["shared_buffer"] * shared_buffer_possible(comm)


def every_combination(comm, counts):
    """Runs every case; returns (failures, digest of all results) for the parent to compare."""
    failures, digest = [], hashlib.sha256()
    algos = algorithms_for(comm) + ["hierarchical"] * hierarchical_possible(comm)
    for count in counts:
        for dtype in TORCH_DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                expect = reference(op, comm.world_size, count, dtype)
                for algo in algos:
                    t = rank_input(comm.rank, count, dtype)
                    comm.all_reduce(t, op=op, algorithm=algo)
                    got = t.double().numpy() if dtype != torch.bool else t.numpy()
                    if dtype == torch.bool:
                        ok = np.array_equal(got, expect)
                    else:
                        ok = np.allclose(got, expect, rtol=tolerance(dtype), atol=tolerance(dtype))
                    if not ok:
                        failures.append(f"count={count} {dtype} {op} {algo}")
                    digest.update(t.view(torch.uint8).numpy().tobytes() if count else b"")
    return failures, digest.hexdigest(), algos


# The slowest test of the suite: each transport runs the world sizes where it differs from the
# others (one rank has no peers; two "mixed" ranks share a fake host, which is plain shm).
WORLDS = {"shm": {1, 2, 3, 4, 5}, "tcp": {2, 3, 4}, "mixed": {3, 4, 5}}


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_op_dtype_algorithm(world, transport):
    if world not in WORLDS[transport]:
        pytest.skip(f"{world} rank(s) over {transport}: covered by the other transports")
    results = run_ranks(
        world, every_combination, COUNTS, timeout=240, comm_timeout=60, env=PIPELINED
    )
    for rank, (failures, _, algos) in enumerate(results):
        assert not failures, f"rank {rank}: {failures[:10]}"
        # two fake hosts of two ranks: the hierarchical all-reduce too
        assert ("hierarchical" in algos) == (transport == "mixed" and world == 4)
        # every rank through shared memory: the shared buffer too, over many rounds of both
        # halves of a 64 KiB board
        assert ("shared_buffer" in algos) == (transport == "shm")
    # results are bitwise identical on every rank
    assert len({digest for _, digest, _ in results}) == 1


def random_float_sums(comm, count, repeats):
    """Float inputs that round differently in different orders: a real determinism check."""
    out = {}
    for algo in algorithms_for(comm):
        runs = []
        for _ in range(repeats):
            gen = torch.Generator().manual_seed(comm.rank)
            t = torch.randn(count, generator=gen) * 10 ** torch.randint(
                -3, 4, (count,), generator=gen
            )
            comm.all_reduce(t, algorithm=algo)
            runs.append(hashlib.sha256(t.numpy().tobytes()).hexdigest())
        out[algo] = runs
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_deterministic_across_ranks_and_runs(world, transport):
    results = run_ranks(world, random_float_sums, 300_001, 3)
    assert ("shared_buffer" in results[0]) == (transport == "shm")
    for algo in results[0]:
        digests = {d for r in results for d in r[algo]}
        assert len(digests) == 1, f"{algo}: {len(digests)} different results"


INTEGER_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]


def integer_ops(comm):
    """The ops only integers have: band/bor/bxor, and avg with NCCL's truncating division."""
    failures = []
    n = comm.world_size
    for count in [0, 7, 4097, 70_001]:
        for dtype in INTEGER_DTYPES:
            xs = [rank_input(r, count, dtype, seed=3) for r in range(n)]
            ops = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
            expects = {op: fn.reduce(np.stack([x.numpy() for x in xs])) for op, fn in ops.items()}
            if dtype != torch.bool:
                # the wrapped-around sum, then C's division (toward zero)
                total = torch.stack(xs).sum(0, dtype=torch.int64).to(dtype).to(torch.int64)
                expects["avg"] = torch.div(total, n, rounding_mode="trunc").to(dtype).numpy()
            for op, expect in expects.items():
                for algo in algorithms_for(comm):
                    t = xs[comm.rank].clone()
                    comm.all_reduce(t, op=op, algorithm=algo)
                    if not np.array_equal(t.numpy(), expect):
                        failures.append(f"count={count} {dtype} {op} {algo}")
    return failures


@pytest.mark.parametrize("world", [3, 4])
def test_bitwise_ops_and_integer_average(world):
    for rank, failures in enumerate(run_ranks(world, integer_ops, timeout=120)):
        assert not failures, f"rank {rank}: {failures[:10]}"


def hierarchical_sums(comm, count):
    """float sums and other ops by the hierarchical all-reduce, against float64, and its choice."""
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(count, generator=gen, dtype=torch.float64)
    everyone = [
        torch.randn(count, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(comm.world_size)
    ]
    out = {}
    for op, expect in (
        ("sum", sum(everyone)),
        ("avg", sum(everyone) / comm.world_size),
        ("max", torch.stack(everyone).max(0).values),
    ):
        digests = set()
        for _ in range(2):
            t = x.float()
            comm.all_reduce(t, op=op, algorithm="hierarchical")
            assert torch.allclose(t.double(), expect, rtol=1e-5, atol=1e-5), op
            digests.add(hashlib.sha256(t.numpy().tobytes()).hexdigest())
        out[op] = digests
    return comm.hosts, comm.algorithm_for(64 << 20), out


# Hosts given per rank: 3 of 2 ranks; 2 of 3; 2 of 2 whose ranks interleave (views map indices).
@pytest.mark.parametrize(
    "hosts", [["a", "a", "b", "b", "c", "c"], ["a", "a", "a", "b", "b", "b"], ["a", "b", "a", "b"]]
)
def test_hierarchical_all_reduce_on_fake_hosts(hosts, transport):
    if transport == "mixed":
        pytest.skip("the hosts are given here: the same as shm")
    env = {r: {"RINGCOMM_HOST_ID": h} for r, h in enumerate(hosts)}
    results = run_ranks(
        len(hosts), hierarchical_sums, 100_003, per_rank_env=env, env=PIPELINED, timeout=120
    )
    layout = [[r for r, h in enumerate(hosts) if h == name] for name in dict.fromkeys(hosts)]
    for got_layout, choice, digests in results:
        assert got_layout == layout and choice == "hierarchical"
        assert all(len(d) == 1 for d in digests.values())  # the same bits, call after call
    for op in ("sum", "avg", "max"):  # and on every rank
        assert len({next(iter(r[2][op])) for r in results}) == 1


def refused(comm, algorithm):
    """Why forcing `algorithm` is refused on this rank, before anything moves."""
    try:
        comm.all_reduce(torch.ones(4), algorithm=algorithm)
    except ValueError as e:
        return str(e)
    return "no error"


def test_hierarchical_needs_hosts_of_equal_size(transport):
    if transport != "shm":
        pytest.skip("a check before anything moves: one transport is enough")
    env = {r: {"RINGCOMM_HOST_ID": h} for r, h in enumerate(["a", "a", "b"])}
    for message in run_ranks(3, refused, "hierarchical", per_rank_env=env):
        assert "several hosts, the same number" in message


def test_shared_buffer_needs_every_rank_in_shared_memory(transport):
    """Over TCP, or with some ranks on another (fake) host, forcing it is a clear error before
    anything moves; so is a board of 0 bytes."""
    if transport == "shm":
        results = run_ranks(2, refused, "shared_buffer", env={"RINGCOMM_SHM_BOARD_BYTES": "0"})
    else:
        results = run_ranks(3 if transport == "mixed" else 2, refused, "shared_buffer")
    for message in results:
        assert "shared_buffer all_reduce needs every rank on one host" in message, message


def shared_buffer_against(comm, count_of, algo_of):
    from ranks import expect_error
    from ringcomm import MismatchError

    t = torch.ones(count_of[comm.rank])
    message, _ = expect_error(
        lambda: comm.all_reduce(t, algorithm=algo_of[comm.rank]), MismatchError
    )
    return message


@pytest.mark.parametrize(
    "count_of, algo_of",
    [
        ([300_000, 300_000, 300_001], ["shared_buffer"] * 3),  # one rank's count differs
        ([300_000] * 3, ["shared_buffer", "shared_buffer", "ring"]),  # one rank's algorithm
    ],
)
def test_a_shared_buffer_mismatch_fails_every_rank_before_a_board_is_read(
    count_of, algo_of, transport
):
    if transport != "shm":
        pytest.skip("the shared buffer runs only where every rank is in shared memory")
    for message in run_ranks(3, shared_buffer_against, count_of, algo_of, timeout=60):
        assert "mismatch" in message.lower(), message
