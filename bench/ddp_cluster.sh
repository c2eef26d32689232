#!/usr/bin/env bash
# DDP training on the simulated cluster (bench/simcluster): one rank per host, every host's link
# shaped to RATE. Runs examples/train_ddp.py once per configuration given, one after the other, each
# on a fresh cluster, with the same arguments otherwise; stops at the first that fails. Prints rank
# 0's output; every rank's log is in the directory bench/simcluster names. Needs root.
#
#   bench/ddp_cluster.sh 4 1gbit "--hook none" "--hook topk --ratio 0.01" -- --width 2048 --epochs 3
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
usage() { echo "usage: $0 HOSTS RATE CONFIG... [-- COMMON_ARGS...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
hosts=$1 rate=$2; shift 2
configs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do configs+=("$1"); shift; done
[ ${#configs[@]} -gt 0 ] || usage
if [ "${1:-}" = "--" ]; then shift; fi
common=("$@")
for config in "${configs[@]}"; do
  echo "=== $config ${common[*]} ($hosts hosts, links $rate)"
  # $config unquoted: one configuration is several arguments.
  bench/simcluster run "$hosts" "$rate" -- "$PY" examples/train_ddp.py $config "${common[@]}"
done
