#!/usr/bin/env bash
# The GPU check, in at most GPU_CHECK_SECONDS (default 480) on a machine with a GPU, CUDA's nvcc
# and a CUDA build of torch: ringcomm built for this GPU's architecture alone, then tests/gpu
# (the kernels, CUDA IPC with 1-8 ranks on one GPU, the Communicator's device path, the bench),
# first with the GPU time-sliced between processes and then, each test under an MPS daemon of its
# own, the MPS cases; then `python -m ringcomm.bench --device cuda` from 8 B to 64 MiB at 2 and 4
# ranks on one GPU beside the device memory floor, time-sliced and under an MPS daemon this
# script starts (its pipe and log directories in a temporary directory, stopped at the end; the
# GPU's compute mode is left alone), with the device path's one_shot and shared_buffer forced
# beside it under MPS; with 2 GPUs or more, also beside NCCL; and bench/ddp_hooks.py, DDP's step
# with each hook against one that does not communicate, 2 ranks on the GPU. A step that would
# overrun the time left is cut short and says so; the next steps still run in what is left.
#
#   bench/gpu_check.sh              # PYTHON: the interpreter (default .venv/bin/python, else python3)
#   bench/gpu_check.sh --dry-run    # every step named with its time limit, none run (no GPU needed)
#
# Writes OUT/gpu_check.json (every step, the tests' counts and failures, each bench run's rows and
# figures, the machine) and OUT/gpu_check.log, and prints the summary last. OUT defaults to
# bench/results/gpu_check_<date>. GPU_CHECK_COMMIT names the commit of a tree copied without
# its .git.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python
else PY=python3
fi
OUT=${OUT:-bench/results/gpu_check_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ringcomm-gpu-check.XXXXXX")
TOTAL=${GPU_CHECK_SECONDS:-480}
START=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

MPS_CONTROL=$(command -v nvidia-cuda-mps-control || true)
MPS_ENV=(CUDA_MPS_PIPE_DIRECTORY="$WORK/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps/log")
MPS_UP=0
mps_control() { env "${MPS_ENV[@]}" "$MPS_CONTROL" "$@"; }
stop_mps() {
  if [ "$MPS_UP" = 1 ]; then
    echo quit | mps_control >/dev/null 2>&1 || true
    MPS_UP=0
  fi
}
trap 'rm -rf "$WORK"' EXIT

left() { echo $((TOTAL - ($(date +%s) - START))); }

record() {  # step, status, seconds, exit code, command (on one line)
  local command=${5//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${command//$'\t'/ }" >>"$WORK/steps.tsv"
}

# step NAME CAP RESERVE CMD...: runs CMD for at most CAP seconds, and at most the time left
# less RESERVE (what the steps after it need), in a process group of its own, killed whole after
# (ranks a test left behind would take the GPU from the next step). 0 if CMD succeeded.
step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local limit=$(($(left) - reserve))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$DRY" = 1 ]; then
    echo "[dry run] $name, up to ${limit} s: $*"
    record "$name" "not run (dry run)" 0 0 "$*"
    return 0
  fi
  if [ "$limit" -lt 15 ]; then
    echo "== $name: not run, ${limit} s left for it"
    record "$name" "not run: no time left" 0 -1 "$*"
    return 1
  fi
  echo "== $name, up to ${limit} s: $*"
  local t0 rc pid status
  t0=$(date +%s)
  setsid timeout -s INT -k 15 "$limit" "$@" &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null || true
  case $rc in
    0) status=ok ;;
    124 | 137) status="cut short at ${limit} s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  record "$name" "$status" $(($(date +%s) - t0)) "$rc" "$*"
  echo "== $name: $status"
  return "$rc"
}

skip() {  # step, why
  echo "== $1: not run, $2"
  record "$1" "not run: $2" 0 -1 ""
}

start_mps() {  # 0 once a daemon of this script's own is up
  [ -n "$MPS_CONTROL" ] || return 1
  mkdir -p "$WORK/mps/pipe" "$WORK/mps/log"
  mps_control -d && MPS_UP=1
}

main() {
  trap stop_mps EXIT  # main runs in a subshell of its own (| tee): its daemon is stopped there
  # The bench sweep's arguments: 8 B to 64 MiB, 20 operations per sample (a latency: each one
  # stream-synchronised), the median of 5.
  SWEEP=(--device cuda -b 8 -e 64M -f 2 -n 20 -w 2 --sample-warmup 5 --repeats 5 --floor)
  BENCH_S=45  # the most one bench run may take

  if [ "$DRY" = 1 ]; then
    GPUS=1
    ARCHS=${RINGCOMM_CUDA_ARCHS:-90-real}
  else
    "$PY" bench/gpu_check_report.py info "$WORK/info.json"
    cat "$WORK/info.json"; echo
    read -r GPUS CAP < <("$PY" -c "import json, sys; i = json.load(open(sys.argv[1]));
print(i['gpus'], i.get('compute_capability', '9.0'))" "$WORK/info.json")
    ARCHS=${RINGCOMM_CUDA_ARCHS:-${CAP/./}-real}  # 9.0: 90-real
  fi
  RUNS=5  # the timed runs after the tests: each bench sweep and the DDP hooks
  [ "$GPUS" -ge 2 ] && RUNS=6

  built=0
  if step build 240 $((200 + RUNS * 20)) env RINGCOMM_CUDA=1 RINGCOMM_CUDA_ARCHS="$ARCHS" \
      "$PY" setup.py -q build_ext --inplace &&
    step "kernels can run" 60 $((180 + RUNS * 20)) "$PY" -c "import ringcomm.cuda as c
ok, why = c.status(); print('ringcomm CUDA kernels:', why or 'ready'); raise SystemExit(not ok)"; then
    built=1
  fi

  if [ "$built" = 1 ] || [ "$DRY" = 1 ]; then
    workers=()
    if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 4); fi
    step "tests/gpu time-sliced" 170 $((90 + RUNS * 30)) "$PY" -m pytest tests/gpu -k "not mps" \
      "${workers[@]}" -q -rfEs -p no:cacheprovider --junitxml="$WORK/tests_time-sliced.xml"
    step "tests/gpu mps" 150 $((RUNS * 30)) "$PY" -m pytest tests/gpu -k mps -q -rfEs \
      -p no:cacheprovider --junitxml="$WORK/tests_mps.xml"
    for ranks in 2 4; do
      step "bench ${ranks} ranks time-sliced" "$BENCH_S" $(((RUNS - 1) * 25)) \
        "$PY" -m ringcomm.bench --ranks "$ranks" "${SWEEP[@]}" \
        --json "$WORK/bench_${ranks}ranks_time-sliced.json"
      RUNS=$((RUNS - 1))
    done
    step "ddp hooks 2 ranks" 60 $(((RUNS - 1) * 25)) "$PY" bench/ddp_hooks.py --device cuda \
      --ranks 2 --timeout 55 --json "$WORK/ddp_2ranks.json"
    RUNS=$((RUNS - 1))
    if [ "$DRY" = 1 ] || start_mps; then
      for ranks in 2 4; do
        step "bench ${ranks} ranks mps" "$BENCH_S" $(((RUNS - 1) * 25)) \
          env "${MPS_ENV[@]}" "$PY" -m ringcomm.bench --ranks "$ranks" "${SWEEP[@]}" \
          --compare one_shot,shared_buffer --json "$WORK/bench_${ranks}ranks_mps.json"
        RUNS=$((RUNS - 1))
      done
      if [ "$MPS_UP" = 1 ]; then  # the servers the runs had: MPS was in use
        echo get_server_list | mps_control >"$WORK/mps_servers.txt" 2>&1 || true
      fi
      stop_mps
    else
      skip "bench mps" "no MPS daemon (nvidia-cuda-mps-control ${MPS_CONTROL:-not found})"
    fi
    if [ "$GPUS" -ge 2 ]; then
      step "bench ${GPUS} ranks vs nccl" "$BENCH_S" 0 "$PY" -m ringcomm.bench --ranks "$GPUS" \
        "${SWEEP[@]}" --compare nccl --json "$WORK/bench_${GPUS}ranks_one-gpu-each.json"
    fi
  else
    skip tests "the build failed"
  fi

  "$PY" bench/gpu_check_report.py assemble "$WORK" "$OUT/gpu_check.json"
  rc=$?
  echo "report: $OUT/gpu_check.json, log: $OUT/gpu_check.log ($(($(date +%s) - START)) s)"
  return $rc
}

# Through tee, which the script waits for: the summary is the output's end.
main 2>&1 | tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
