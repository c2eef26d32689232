#!/usr/bin/env bash
# What to run on the first machine with a GPU (the CPU suite skips tests/gpu/ elsewhere): the GPU
# tests, then the kernel benchmark against torch, then (with 2 GPUs or more) all_reduce over NCCL,
# ringcomm's schedules against NCCL's own all-reduce, one rank per GPU. Writes everything to OUT (default
# bench/results/gpu_<date>) and prints the report to paste into docs/performance.md.
#
# Needs a CUDA build of torch in the environment (not the project's CPU pin), e.g.
#   python -m venv /tmp/gpu && /tmp/gpu/bin/pip install torch --index-url .../cu130
#   /tmp/gpu/bin/pip install -e '.[test]'      # builds ringcomm._C_cuda with nvcc
#   PYTHON=/tmp/gpu/bin/python bench/gpu_check.sh
# or, on a machine without network access where torch with CUDA is installed already:
#   RINGCOMM_CUDA=1 RINGCOMM_CUDA_ARCHS=90-real python3 setup.py -q build_ext --inplace
#   PYTHONPATH=$PWD PYTHON=python3 bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
OUT=${OUT:-bench/results/gpu_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
"$PY" - <<'PY' | tee "$OUT/device.txt"
import torch, ringcomm.cuda as c
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
ok, reason = c.status()
print("ringcomm CUDA kernels:", "ready" if ok else "cannot run: " + reason)
raise SystemExit(0 if ok else 2)
PY
status=0
"$PY" -m pytest tests/gpu -q -rs --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
"$PY" -m ringcomm.bench.kernels gpu --repeats 20 --json "$OUT/gpu_kernels.json" 2>&1 | tee "$OUT/gpu_kernels.md" || status=1
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  for algo in ring tree recursive_doubling auto; do
    "$PY" -m ringcomm.bench --ranks "$gpus" -b 8 -e 256M -f 4 --algo "$algo" --compare nccl \
      --json "$OUT/nccl_allreduce_$algo.json" 2>&1 | tee "$OUT/nccl_allreduce_$algo.md" || status=1
  done
else
  echo "all_reduce over NCCL: not run, NCCL takes one GPU per rank and this machine has $gpus" \
    | tee "$OUT/nccl_allreduce.md"
fi
echo "report: $OUT (tests: gpu_tests.txt, kernels: gpu_kernels.md, NCCL: nccl_allreduce_*.md)"
exit $status
