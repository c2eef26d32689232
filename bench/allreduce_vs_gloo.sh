#!/usr/bin/env bash
# Reproduces the all_reduce tables of docs/performance.md: ringcomm vs torch's gloo, in one run per
# world size, over TCP loopback. Usage: bench/allreduce_vs_gloo.sh [python]  (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
for ranks in 2 4; do
  "$PY" -m ringcomm.bench --ranks "$ranks" --sizes 8,4K,64K,1M,16M,64M --repeats 7 \
    --compare gloo --json "bench/results/allreduce_${ranks}ranks.json"
done
