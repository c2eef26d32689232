"""bench/simcluster: hosts, ranks, their env and logs, shaping, and that nothing is left behind.

Needs root and network namespaces; skipped otherwise. Every call has a deadline, and a run that
misses it gets SIGTERM (so that it still tears its cluster down) before it is killed.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMCLUSTER = os.path.join(ROOT, "bench", "simcluster")
STATE = "/run/ringcomm-simcluster"
DEADLINE = 60


def _unusable():
    if os.geteuid() != 0:
        return "needs root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs ip and tc (iproute2)"
    # Not rcsim<N>: a name of the cluster's own would be removed by a concurrent down.
    name = f"rcsimtest{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
    if added.returncode != 0:
        return f"ip netns add fails: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


_reason = _unusable()
pytestmark = pytest.mark.skipif(_reason is not None, reason=str(_reason))

# Each rank prints its env, then every rank but 0 connects to MASTER_ADDR:MASTER_PORT, says hello
# and sends PAYLOAD bytes; rank 0 names each peer's address and the time the payload took.
PROBE = r"""
import os, socket, sys, time
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RINGCOMM_HOST_ID",
        "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
payload = int(sys.argv[1])
if rank == 0:
    with socket.create_server(addr) as srv:
        srv.settimeout(30)
        for _ in range(world - 1):
            conn, peer = srv.accept()
            with conn, conn.makefile("rb") as f:
                hello = f.readline().decode().strip()
                start = time.perf_counter()
                left = payload
                while left:
                    left -= len(f.read(min(left, 1 << 16)))
                conn.sendall(b"ack\n")
                print(f"from {peer[0]}: {hello} ({time.perf_counter() - start:.3f} s)", flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(addr, timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock, sock.makefile("rb") as f:
        sock.sendall(f"hello from rank {rank}\n".encode() + bytes(payload))
        print("got", f.readline().decode().strip(), flush=True)
"""


def simcluster(*args, env=None, deadline=DEADLINE):
    proc = subprocess.Popen(
        [SIMCLUSTER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"simcluster {' '.join(args)} missed its {deadline} s deadline:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE)


def leftovers():
    """What of a simcluster exists now: namespaces, links, the state file."""
    found = [
        line.split()[0]
        for line in sh("ip", "netns", "list").stdout.splitlines()
        if re.fullmatch(r"rcsim\d+", line.split()[0])
    ]
    found += [
        line.split()[0]
        for line in sh("ip", "-br", "link").stdout.splitlines()
        if re.match(r"rcsim(v\d+|br)(@|$)", line.split()[0])
    ]
    return found + ([STATE] if os.path.exists(STATE) else [])


@pytest.fixture(autouse=True)
def _clean():
    yield
    if leftovers():
        simcluster("down")
        pytest.fail("a simcluster was left behind")


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return [sys.executable, str(path)]


def logs(out, world):
    assert sorted(os.listdir(out)) == sorted(f"rank{r}.log" for r in range(world))
    return [(out / f"rank{r}.log").read_text() for r in range(world)]


def test_two_hosts_env_logs_and_tcp_between_hosts(tmp_path, probe):
    out = tmp_path / "logs"
    # 4 MB at 100 Mbit/s: about 0.3 s past tbf's 256 KiB burst; unshaped, milliseconds.
    run = simcluster(
        "run", "2", "100mbit", "--port", "29123", "--out", str(out), "--", *probe, str(4 << 20)
    )
    assert run.returncode == 0, run.stderr
    rank0, rank1 = logs(out, 2)
    assert (
        "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 "
        "RINGCOMM_HOST_ID=simhost0 MASTER_ADDR=198.18.0.1 MASTER_PORT=29123 "
        "GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1"
    ) in rank0
    assert (
        "RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=1 "
        "RINGCOMM_HOST_ID=simhost1 MASTER_ADDR=198.18.0.1"
    ) in rank1
    seconds = re.search(r"from 198\.18\.0\.2: hello from rank 1 \(([\d.]+) s\)", rank0)
    assert seconds, rank0
    assert 0.2 < float(seconds.group(1)) < 4, "the link is not shaped to 100 Mbit/s"
    assert "got ack" in rank1
    assert rank0 in run.stdout  # printed live, and nobody else's output
    assert "RANK=1" not in run.stdout
    assert leftovers() == []


def test_ranks_per_host(tmp_path, probe):
    out = tmp_path / "logs"
    run = simcluster(
        "run", "2", "100mbit", "--ranks-per-host", "2", "--out", str(out), "--", *probe, "0"
    )
    assert run.returncode == 0, run.stderr
    texts = logs(out, 4)
    for r, text in enumerate(texts):
        host, local = divmod(r, 2)
        assert (
            f"RANK={r} WORLD_SIZE=4 LOCAL_RANK={local} LOCAL_WORLD_SIZE=2 GROUP_RANK={host} "
            f"RINGCOMM_HOST_ID=simhost{host} MASTER_ADDR=198.18.0.1"
        ) in text, text
    peers = sorted(re.findall(r"from ([\d.]+): hello from rank (\d)", texts[0]))
    assert peers == [("198.18.0.1", "1"), ("198.18.0.2", "2"), ("198.18.0.2", "3")]
    assert leftovers() == []


def test_failing_rank_names_it_and_stops_the_others(tmp_path):
    out = tmp_path / "logs"
    env = dict(os.environ, SIMCLUSTER_GRACE_S="1")
    start = time.monotonic()
    run = simcluster(
        "run",
        "3",
        "100mbit",
        "--out",
        str(out),
        "--",
        "sh",
        "-c",
        'echo "rank $RANK up"; [ "$RANK" != 2 ] || { echo boom >&2; exit 3; }; exec sleep 97.5',
        env=env,
    )
    assert run.returncode == 3
    assert "rank 2 exited with status 3" in run.stderr
    assert "boom" in run.stderr  # the failing rank's last lines
    assert time.monotonic() - start < 20
    assert "boom" in (out / "rank2.log").read_text()
    assert leftovers() == []
    assert "sleep 97.5" not in sh("ps", "-eo", "args").stdout


def _default_sigint():
    """A shell started with SIGINT ignored (from a background job, as `cmd &` in a script does,
    or under nohup) can neither trap nor reset it: give the script the default disposition, as a
    terminal would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_sleeping_run(out):
    """A run of 4 ranks on 2 hosts that sleep, once every rank has started."""
    proc = subprocess.Popen(
        [
            SIMCLUSTER,
            "run",
            "2",
            "100mbit",
            "--ranks-per-host",
            "2",
            "--out",
            str(out),
            "--",
            "sh",
            "-c",
            "echo up; exec sleep 100",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + DEADLINE
    logs = [out / f"rank{r}.log" for r in range(4)]
    while not all(log.exists() and "up" in log.read_text() for log in logs):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the ranks did not start: {proc.communicate()}")
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_tears_down(tmp_path, sig):
    proc = start_sleeping_run(tmp_path / "logs")
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -sig, err
    assert f"{sig.name}, stopping the ranks" in err
    assert leftovers() == []


def test_a_running_cluster_is_not_replaced(tmp_path):
    proc = start_sleeping_run(tmp_path / "logs")
    try:
        assert f"in use by 'simcluster run', pid {proc.pid}" in simcluster("status").stdout
        for args in (["up", "1", "1gbit"], ["run", "1", "1gbit", "--", "true"]):
            refused = simcluster(*args)
            assert refused.returncode == 2 and "in use by a running" in refused.stderr
        assert "rcsim1" in sh("ip", "netns", "list").stdout
        proc.terminate()
        proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert leftovers() == []


def test_up_status_down_and_no_way_out():
    up = simcluster("up", "2", "100mbit", "--ranks-per-host", "3")
    assert up.returncode == 0, up.stderr
    with open(STATE) as f:
        state = f.read()
    assert "hosts=2\nrate=100mbit\nranks_per_host=3\n" in state
    status = simcluster("status").stdout
    assert "hosts 2, links 100mbit, 3 rank(s) per host" in status
    assert re.search(
        r"rcsim1 198\.18\.0\.2/24 +out: tbf rate 100Mbit .* in: tbf rate 100Mbit", status
    ), status
    for ns in ("rcsim0", "rcsim1"):
        assert sh("ip", "-n", ns, "route").stdout.split()[0] == "198.18.0.0/24"
        for family in ("-4", "-6"):
            routes = sh("ip", family, "-n", ns, "route", "show", "table", "all").stdout
            assert "default" not in routes, routes
    # Only the hosts on the bridge, and no address on the root namespace's side of it.
    ports = sh("ip", "-br", "link", "show", "master", "rcsimbr").stdout.split("\n")
    assert sorted(p.split()[0].split("@")[0] for p in ports if p) == ["rcsimv0", "rcsimv1"]
    assert sh("ip", "-br", "addr", "show", "dev", "rcsimbr").stdout.split()[2:] == []
    escape = sh(
        "ip",
        "netns",
        "exec",
        "rcsim0",
        sys.executable,
        "-c",
        "import socket; socket.create_connection(('192.0.2.1', 9), timeout=5)",
    )
    assert "Network is unreachable" in escape.stderr
    # up replaces the cluster it finds.
    again = simcluster("up", "1", "1gbit")
    assert again.returncode == 0, again.stderr
    assert "rcsim1" not in sh("ip", "netns", "list").stdout
    assert sh("tc", "qdisc", "show", "dev", "rcsimv0").stdout.split()[:2] == ["qdisc", "tbf"]
    assert simcluster("down").returncode == 0
    assert leftovers() == []
    assert simcluster("down").returncode == 0
    assert simcluster("status").stdout.strip() == "no simcluster"


def test_delay_needs_netem():
    netem = (
        sh(
            "unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"
        ).returncode
        == 0
    )
    up = simcluster("up", "2", "100mbit", "--delay", "5")
    if netem:
        assert up.returncode == 0, up.stderr
        assert "netem" in sh("tc", "-n", "rcsim0", "qdisc", "show", "dev", "eth0").stdout
        assert "netem" not in sh("tc", "qdisc", "show", "dev", "rcsimv0").stdout
        simcluster("down")
    else:
        assert up.returncode == 2
        assert "--delay needs the netem qdisc" in up.stderr
    assert leftovers() == []


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["up"],
        ["up", "2"],
        ["up", "0", "1gbit"],
        ["up", "2", "1000"],
        ["run", "2", "1gbit"],
        ["run", "2", "1gbit", "--bogus", "--", "true"],
        ["up", "2", "1gbit", "--", "true"],
        ["down", "now"],
    ],
)
def test_bad_arguments(args):
    run = simcluster(*args)
    assert run.returncode == 2
    assert "usage:" in run.stderr or "must be" in run.stderr, run.stderr
    assert leftovers() == []
