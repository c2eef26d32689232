#!/usr/bin/env bash
# Reproduces docs/performance.md's all_reduce tables over shared memory: ringcomm beside torch's
# gloo and Open MPI, with the memory floor, one run per world size (2 and 4 local ranks), each
# written with every sample (and the run's machine, commit and date) to
# bench/results/allreduce_shm_<ranks>ranks_<MACHINE>.json, then printed by bench/report.py.
# Usage: bench/allreduce_vs_gloo.sh MACHINE [python]
#   MACHINE: the host's name in the file names (docs/performance.md, "Machines": epyc-2vcpu, ...);
#   python: default .venv/bin/python (Open MPI: pip install 'ringcomm[mpi]', which `make` installs).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 MACHINE [python]" >&2; exit 2; }
MACHINE=$1
PY=${2:-.venv/bin/python}
files=()
for ranks in 2 4; do
  out="bench/results/allreduce_shm_${ranks}ranks_${MACHINE}.json"
  "$PY" -m ringcomm.bench --ranks "$ranks" --sizes 8,4K,64K,1M,16M,64M --repeats 7 \
    --compare gloo,mpi --floor --json "$out"
  files+=("$out")
done
"$PY" bench/report.py "${files[@]}"
