#!/usr/bin/env bash
# DDP training on the simulated cluster (bench/netns_cluster.sh): one rank per network namespace,
# every host's link shaped to RATE. Runs examples/train_ddp.py once per configuration given, one
# after the other, with the same arguments otherwise. Needs root.
#
#   bench/ddp_cluster.sh 4 1gbit "--hook none" "--hook topk --ratio 0.01" -- --width 2048 --epochs 3
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
ranks=${1:?ranks}; rate=${2:?rate}; shift 2
configs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do configs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
common=("$@")
bench/netns_cluster.sh up "$ranks" "$rate"
trap 'bench/netns_cluster.sh down' EXIT
port=29400
for config in "${configs[@]}"; do
  port=$((port + 1))
  echo "=== $config ${common[*]} ($ranks hosts, links $rate)"
  pids=()
  for r in $(seq 0 $((ranks - 1))); do
    bench/netns_cluster.sh run "$r" env RANK="$r" WORLD_SIZE="$ranks" LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR=10.77.0.1 MASTER_PORT="$port" GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
      "$PY" examples/train_ddp.py $config "${common[@]}" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
done
