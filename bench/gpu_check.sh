#!/usr/bin/env bash
# What to run on the first machine with a GPU (the CPU suite skips tests/gpu/ elsewhere): the GPU
# tests, then the kernel benchmark against torch. Writes everything to OUT (default
# bench/results/gpu_<date>) and prints the report to paste into docs/performance.md.
#
# Needs a CUDA build of torch in the environment (not the project's CPU pin), e.g.
#   python -m venv /tmp/gpu && /tmp/gpu/bin/pip install torch --index-url .../cu130
#   /tmp/gpu/bin/pip install -e '.[test]'      # builds ringcomm._C_cuda with nvcc
#   PYTHON=/tmp/gpu/bin/python bench/gpu_check.sh
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
"$PY" -m ringcomm.bench_kernels gpu --repeats 20 --json "$OUT/gpu_kernels.json" 2>&1 | tee "$OUT/gpu_kernels.md" || status=1
echo "report: $OUT (tests: gpu_tests.txt, kernels: gpu_kernels.md)"
exit $status
