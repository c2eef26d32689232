#!/usr/bin/env bash
# A simulated cluster on one machine: N network namespaces ("hosts") rc0..rc(N-1), each with one
# veth link to a shared bridge, every link shaped with tbf to RATE in both directions (like a
# full-duplex NIC). Host i has address 10.77.0.(i+1). Needs root (ip, tc).
#
#   bench/netns_cluster.sh up 4 1gbit     # create (replacing an existing one)
#   bench/netns_cluster.sh run 2 CMD...   # run CMD inside host 2
#   bench/netns_cluster.sh down           # remove
set -euo pipefail
BRIDGE=rcbr0
cmd=${1:-}
down() {
  for ns in $(ip netns list | awk '/^rc[0-9]+/ {print $1}'); do ip netns del "$ns"; done
  ip link del "$BRIDGE" 2>/dev/null || true
}
case "$cmd" in
  up)
    n=${2:?number of hosts}; rate=${3:?rate, e.g. 1gbit}
    down
    ip link add "$BRIDGE" type bridge
    ip link set "$BRIDGE" up
    for i in $(seq 0 $((n - 1))); do
      ns=rc$i
      ip netns add "$ns"
      ip link add "rcv$i" type veth peer name eth0 netns "$ns"
      ip link set "rcv$i" master "$BRIDGE" up
      ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
      # burst: enough for the rate at a 1 ms timer tick; latency bounds the queue.
      tc qdisc add dev "rcv$i" root tbf rate "$rate" burst 256kb latency 20ms
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 20ms
    done
    echo "cluster: $n hosts 10.77.0.1-$n, links $rate"
    ;;
  run)
    host=${2:?host index}; shift 2
    exec ip netns exec "rc$host" "$@"
    ;;
  down) down ;;
  *) echo "usage: $0 up N RATE | run I CMD... | down" >&2; exit 2 ;;
esac
