"""The TCP handshake (csrc/transport/tcp/handshake.h, docs/security.md), spoken here from Python
against real ranks: strangers, wrong tokens, impostors, other protocol versions, token files, and
a peer that knows the token but then sends bytes that do not add up."""

import hashlib
import hmac
import os
import socket
import struct
import time
from datetime import timedelta

import pytest
import torch

import ringcomm
from ranks import expect_error, run_ranks

MAGIC = 0x524D4348
BYTE_ORDER = 0x01020304
PROTOCOL_VERSION = 4
HELLO = struct.Struct(
    "<IIIIiiii32s"
)  # magic, byte order, version, reserved, world, rank, socket, sockets, nonce
REPLY = struct.Struct("<IiI")  # magic, accepted, the acceptor's protocol version
CHALLENGE = struct.Struct("<IiIi32s32s")  # a Reply, the acceptor's rank, its nonce, its MAC
PROOF = struct.Struct("<II32s")  # magic, reserved, MAC
HEADER = struct.Struct("<IBBBBBBHiQQQQ")  # csrc/transport/wire.h WireHeader
MESSAGE_MAGIC = 0x524D4331


def header(kind=1, coll=1, count=4, payload=16, aux=0):
    """A message header as rank 0's all_reduce(4 float32, recursive_doubling) #0 expects it."""
    return HEADER.pack(MESSAGE_MAGIC, kind, coll, 0, 0, 3, 0, 0, -1, 0, count, aux, payload)


def abort_frame(error_kind, reason=b"its own reason"):
    """An abort (message kind 2): the reason as payload, its error kind in `aux`."""
    return header(kind=2, coll=0, count=0, payload=len(reason), aux=error_kind) + reason


def mac(token, label, *parts):
    return hmac.new(token, label + b"\0" + b"".join(parts), hashlib.sha256).digest()


def read_exactly(conn, n):
    data = b""
    while len(data) < n:
        try:
            chunk = conn.recv(n - len(data))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data
        data += chunk
    return data


def rank0_endpoint(prefixed):
    prefixed.wait(["addr/0"], timedelta(seconds=20))
    fields = dict(f.split("=", 1) for f in prefixed.get("addr/0").decode().split(";"))
    host, port = fields["tcp"].rsplit(":", 1)
    return host, int(port)


def python_rank1(prefixed, token, version=PROTOCOL_VERSION, before_dialling=lambda: None):
    """Rank 1 of a 2-rank job, written in Python: dials rank 0 and does the handshake. Returns the
    socket and rank 0's reply (a Reply; on acceptance, the final one)."""
    host, port = rank0_endpoint(prefixed)
    prefixed.set("addr/1", "host=python;tcp=127.0.0.1:9")  # never dialled: 1 dials 0
    before_dialling()
    conn = socket.create_connection((host, port), timeout=20)
    hello = HELLO.pack(MAGIC, BYTE_ORDER, version, 0, 2, 1, 0, 1, os.urandom(32))
    conn.sendall(hello)
    reply = REPLY.unpack(read_exactly(conn, REPLY.size))
    if not reply[1]:
        return conn, reply
    rank, nonce, acceptor_mac = struct.unpack(
        "<i32s32s", read_exactly(conn, CHALLENGE.size - REPLY.size)
    )
    assert rank == 0 and acceptor_mac == mac(
        token, b"ringcomm acceptor", hello, nonce, struct.pack("<i", rank)
    )
    conn.sendall(PROOF.pack(MAGIC, 0, mac(token, b"ringcomm connector", hello, nonce)))
    return conn, REPLY.unpack(read_exactly(conn, REPLY.size))


def test_hmac_matches_python():
    for key_bytes in (1, 32, 64, 65, 200):
        for size in (0, 1, 55, 56, 63, 64, 65, 1000):
            key, message = os.urandom(key_bytes), os.urandom(size)
            assert (
                ringcomm._C._hmac_sha256(key, message)
                == hmac.new(key, message, hashlib.sha256).digest()
            )


def python_peer_knowing_the_token(store, rank, world):
    prefixed = torch.distributed.PrefixStore("ringcomm/python", store)
    if rank == 1:
        prefixed.wait(["token"], timedelta(seconds=20))
        conn, reply = python_rank1(prefixed, prefixed.get("token"))
        conn.sendall(header() + struct.pack("<4f", 1, 2, 3, 4))  # an all_reduce's one message
        answer = read_exactly(conn, HEADER.size + 16)
        conn.close()
        return reply, struct.unpack("<4f", answer[HEADER.size :])
    comm = ringcomm.Communicator(store, 0, 2, timeout=timedelta(seconds=20), name="python")
    t = torch.tensor([10.0, 20.0, 30.0, 40.0])
    comm.all_reduce(t, algorithm="recursive_doubling")
    comm.close()
    return t.tolist()


def test_a_python_peer_that_knows_the_token_joins():
    """The handshake as documented, spoken by Python's hmac: rank 0 accepts it and all-reduces."""
    reduced, (reply, received) = run_ranks(
        2,
        python_peer_knowing_the_token,
        make_comm=False,
        timeout=60,
        env={"RINGCOMM_TRANSPORT": "tcp"},
    )
    assert reply == (MAGIC, 1, PROTOCOL_VERSION)
    assert reduced == [11.0, 22.0, 33.0, 44.0]
    assert received == (10.0, 20.0, 30.0, 40.0)


def stranger_and_two_ranks(store, rank, world):
    """Rank 0 meets two strangers before its rank 1 (a Python peer that knows the token) dials:
    one with a well-formed hello but a wrong proof, one sending garbage."""
    prefixed = torch.distributed.PrefixStore("ringcomm/stranger", store)
    if rank == 2:  # the stranger
        host, port = rank0_endpoint(prefixed)
        wrong_token = socket.create_connection((host, port), timeout=20)
        hello = HELLO.pack(MAGIC, BYTE_ORDER, PROTOCOL_VERSION, 0, 2, 1, 0, 1, os.urandom(32))
        wrong_token.sendall(hello)
        garbage = socket.create_connection((host, port), timeout=20)
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 200)
        challenge = CHALLENGE.unpack(read_exactly(wrong_token, CHALLENGE.size))
        wrong_token.sendall(
            PROOF.pack(MAGIC, 0, mac(b"not-the-token", b"ringcomm connector", hello, challenge[4]))
        )
        verdict = read_exactly(wrong_token, REPLY.size + 1)  # a refusal, then end of stream
        answer = read_exactly(garbage, REPLY.size + 1)
        store.set("stranger_done", "1")
        wrong_token.close()
        garbage.close()
        return challenge[1], verdict, answer
    if rank == 1:
        prefixed.wait(["token"], timedelta(seconds=20))
        conn, reply = python_rank1(
            prefixed, prefixed.get("token"), before_dialling=lambda: store.wait(["stranger_done"])
        )
        conn.close()
        return reply
    comm = ringcomm.Communicator(store, 0, 2, timeout=timedelta(seconds=20), name="stranger")
    comm.close()
    return True


def test_strangers_and_wrong_tokens_are_refused():
    ok, reply, (challenged, verdict, answer) = run_ranks(
        3, stranger_and_two_ranks, make_comm=False, timeout=60
    )
    assert ok and reply == (MAGIC, 1, PROTOCOL_VERSION)  # the job formed after the strangers
    refusal = REPLY.pack(MAGIC, 0, PROTOCOL_VERSION)
    assert challenged == 1  # a well-formed Hello is challenged, whoever sends it
    assert verdict == refusal, verdict  # a wrong proof: refused, and the connection closed
    assert answer in (refusal, b""), answer  # garbage: refused (a reset may overtake the reply)


def impostor_at_rank0(store, rank, world):
    """Rank 0's address is served by a process that does not know the token (a stale address
    reused by another job): rank 1 must refuse to talk to it, saying so."""
    prefixed = torch.distributed.PrefixStore("ringcomm/impostor", store)
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(20)
        prefixed.set("addr/0", f"host=impostor;tcp=127.0.0.1:{listener.getsockname()[1]}")
        conn, _ = listener.accept()
        hello = read_exactly(conn, HELLO.size)
        nonce = os.urandom(32)
        conn.sendall(
            CHALLENGE.pack(
                MAGIC,
                1,
                PROTOCOL_VERSION,
                0,
                nonce,
                mac(
                    b"another job's token", b"ringcomm acceptor", hello, nonce, struct.pack("<i", 0)
                ),
            )
        )
        proof = read_exactly(conn, PROOF.size)
        conn.close()
        return proof
    prefixed.set("token", "the job's token")
    return expect_error(
        lambda: ringcomm.Communicator(store, 1, 2, timeout=timedelta(seconds=20), name="impostor")
    )


def test_an_impostor_at_a_rank_address_is_named():
    proof, (message, elapsed) = run_ranks(2, impostor_at_rank0, make_comm=False, timeout=60)
    assert "is not rank 0 of this job" in message and "job token" in message, message
    assert elapsed < 5, elapsed
    assert PROOF.unpack(proof)[2] == bytes(32)  # no proof given to a process that gave none


def older_acceptor(store, rank, world):
    prefixed = torch.distributed.PrefixStore("ringcomm/older_acceptor", store)
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(20)
        prefixed.set("addr/0", f"host=older;tcp=127.0.0.1:{listener.getsockname()[1]}")
        prefixed.set("token", "the job's token")
        conn, _ = listener.accept()
        read_exactly(conn, HELLO.size)
        conn.sendall(REPLY.pack(MAGIC, 0, PROTOCOL_VERSION - 1))
        conn.close()
        return None
    return expect_error(
        lambda: ringcomm.Communicator(
            store, 1, 2, timeout=timedelta(seconds=20), name="older_acceptor"
        )
    )


def older_connector(store, rank, world):
    prefixed = torch.distributed.PrefixStore("ringcomm/older_connector", store)
    if rank == 1:
        conn, reply = python_rank1(prefixed, b"", version=PROTOCOL_VERSION - 1)
        conn.close()
        return reply
    return expect_error(
        lambda: ringcomm.Communicator(
            store, 0, 2, timeout=timedelta(seconds=3), name="older_connector"
        )
    )


def test_mixed_protocol_versions_fail_clearly():
    # The connecting rank learns the acceptor's version from its reply and fails at once.
    _, (message, elapsed) = run_ranks(2, older_acceptor, make_comm=False, timeout=60)
    assert f"version {PROTOCOL_VERSION - 1}" in message and "same ringcomm" in message, message
    assert elapsed < 5, elapsed
    # The accepting rank cannot tell an unauthenticated Hello of another version from a stranger's,
    # so it refuses it (saying which version it runs) and keeps waiting; if no rank of its
    # version comes, its timeout says why the last connection was refused.
    (message, elapsed), reply = run_ranks(2, older_connector, make_comm=False, timeout=60)
    assert reply == (MAGIC, 0, PROTOCOL_VERSION)
    assert "Timed out" in message and f"protocol version {PROTOCOL_VERSION - 1}" in message, message


def with_token_file(store, rank, world, tokens):
    path = os.path.join(os.environ["TOKEN_DIR"], f"token{rank}")
    with open(path, "w") as f:
        f.write(tokens[rank] + "\n")
    os.environ["RINGCOMM_TOKEN_FILE"] = path
    make = lambda: ringcomm.Communicator(
        store, rank, world, timeout=timedelta(seconds=4), name="file"
    )
    if tokens[0] != tokens[1]:
        return expect_error(make)[0]
    comm = make()
    t = torch.ones(10)
    comm.all_reduce(t)
    comm.close()
    in_store = torch.distributed.PrefixStore("ringcomm/file", store).check(["token"])
    return t.tolist(), in_store


@pytest.mark.parametrize("same", [True, False])
def test_token_file(tmp_path, same):
    tokens = ["a secret shared out of band"] * 2 if same else ["one secret", "another secret"]
    results = run_ranks(
        2, with_token_file, tokens, make_comm=False, timeout=60, env={"TOKEN_DIR": str(tmp_path)}
    )
    if same:
        for reduced, in_store in results:
            assert reduced == [2.0] * 10
            assert not in_store  # whoever reads the Store learns no token
    else:
        rank0, rank1 = results
        assert "cannot prove that it knows the job token" in rank1, rank1
        assert "no proof of the job token" in rank0, rank0


# A peer that passed the handshake, then sends what a correct rank never would. Rank 0 must
# raise a clear error naming it, of the class for what happened — never crash, hang or accept
# the bytes.
BAD_BYTES = {
    "garbage": (os.urandom(64), "bad message magic", "ProtocolError"),
    "truncated header": (header()[:20], "rank 1", "PeerLostError"),
    "other collective": (header(coll=5) + bytes(16), "mismatch", "MismatchError"),
    "other count": (header(count=5, payload=20) + bytes(20), "mismatch", "MismatchError"),
    "payload that does not add up": (header(payload=1 << 40), "bytes", "ProtocolError"),
    "unknown kind": (header(kind=9) + bytes(16), "unknown kind", "ProtocolError"),
    # an abort is raised as the kind it names (3: a mismatch rank 1 saw)...
    "abort": (abort_frame(3), "rank 1 aborted: its own reason", "MismatchError"),
    # ... and a kind there is not is itself bytes that do not add up
    "abort of no kind": (abort_frame(6), "aborted with error kind 6", "ProtocolError"),
}


def peer_sending(store, rank, world, case):
    prefixed = torch.distributed.PrefixStore("ringcomm/bad", store)
    if rank == 1:
        prefixed.wait(["token"], timedelta(seconds=20))
        conn, reply = python_rank1(prefixed, prefixed.get("token"))
        assert reply[1] == 1
        conn.sendall(BAD_BYTES[case][0])
        conn.shutdown(socket.SHUT_WR)
        read_exactly(conn, 1 << 20)  # until rank 0 closes
        conn.close()
        return None
    comm = ringcomm.Communicator(store, 0, 2, timeout=timedelta(seconds=10), name="bad")
    t = torch.ones(4)
    message, elapsed = expect_error(
        lambda: comm.all_reduce(t, algorithm="recursive_doubling"),
        getattr(ringcomm, BAD_BYTES[case][2]),
    )
    comm.close()
    return message, elapsed


@pytest.mark.parametrize("case", sorted(BAD_BYTES))
def test_bytes_from_a_peer_that_do_not_add_up(case):
    (message, elapsed), _ = run_ranks(
        2, peer_sending, case, make_comm=False, timeout=60, env={"RINGCOMM_TRANSPORT": "tcp"}
    )
    assert BAD_BYTES[case][1] in message and "rank 1" in message, message
    assert elapsed < 5, elapsed


def silent_crowd(store, rank, world):
    """Rank 0 waits for a rank 1 that never comes while 80 connections that never say hello pile
    up: it keeps at most 65 of them waiting (its one expected peer plus 64), closing the oldest."""
    prefixed = torch.distributed.PrefixStore("ringcomm/crowd", store)
    if rank == 1:
        host, port = rank0_endpoint(prefixed)
        prefixed.set("addr/1", "host=elsewhere;tcp=127.0.0.1:9")  # never dialled: 1 dials 0
        time.sleep(0.3)  # rank 0 is in its accept loop
        crowd = [socket.create_connection((host, port), timeout=20) for _ in range(80)]
        time.sleep(1.0)  # well within the 5 s each is allowed for its hello
        dropped = 0
        for conn in crowd:
            conn.setblocking(False)
            try:
                dropped += conn.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                dropped += 1
            conn.close()
        return dropped
    return expect_error(
        lambda: ringcomm.Communicator(store, 0, 2, timeout=timedelta(seconds=3), name="crowd")
    )[0]


def test_connections_without_a_handshake_are_capped():
    message, dropped = run_ranks(2, silent_crowd, make_comm=False, timeout=60)
    assert dropped >= 80 - 65, dropped
    assert "Timed out waiting for 1 connection" in message, message
