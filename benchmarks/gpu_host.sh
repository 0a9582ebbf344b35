#!/usr/bin/env bash
# What issues 13 and 16 still need from a machine with a GPU and 16 cores, in three runs of under
# 10 minutes each, every output kept under $OUT:
#
#   bash benchmarks/gpu_host.sh tests    # GPU tests, then the whole suite on that machine's Python
#   bash benchmarks/gpu_host.sh scale    # issue 16: bench on 0..14 workers, hotpath.py, floor.py, pages.py, paced ab.py
#   bash benchmarks/gpu_host.sh cuda     # issue 13: bench --device cuda, bench --train
#
# Runs from the repository root with that machine's python3 (torch with CUDA, numpy, psutil,
# cloudpickle, pluggy, pytest, pytest-timeout already there; nothing is installed). Each step has
# its own time bound, so one slow step cannot cost the others; a step that fails or times out is
# noted in $OUT/summary.txt and the rest still run. On a machine without CUDA the GPU steps skip
# (tests) or fail fast (bench --device cuda), which is how the script was checked.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/shmloader-gpu-host}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PY="${PYTHON:-python3}"

# Few files under $OUT: the small probes share one file, a --json step keeps its
# document (stdout) apart from its table (stderr).
step() {  # step NAME SECONDS COMMAND...: bounded; stdout+stderr appended to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $*" >>"$OUT/$name.txt"
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s: $*" | tee -a "$OUT/summary.txt"
}

jstep() {  # jstep NAME SECONDS COMMAND...: as step, stdout (the --json document) to $OUT/NAME.json
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.txt"
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s: $*" | tee -a "$OUT/summary.txt"
}

machine() {
    {
        date -u
        nproc
        "$PY" -c "import sys, numpy, torch; print(sys.version); print('numpy', numpy.__version__, 'torch', torch.__version__,
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
    } >"$OUT/machine.txt" 2>&1
}

case "${1:-}" in
tests)
    machine
    step gpu_tests 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
    step suite 450 "$PY" -m pytest -q -x -p no:cacheprovider
    ;;
scale)
    machine
    jstep bench_workers 380 "$PY" -m shmloader bench --workers 0,1,2,4,8,14 --repeat 3 --json
    for n in 2 8 14; do
        step probes 25 "$PY" benchmarks/hotpath.py --workers "$n" --poll --batches 10000 --repeats 3
    done
    step probes 25 "$PY" benchmarks/floor.py
    step probes 25 "$PY" benchmarks/pages.py
    # a 150 us training step sets the pace: the main CPU inside next(), shmloader and torch
    step probes 75 "$PY" benchmarks/ab.py WORKTREE TORCH --consumer-us 150 --rounds 3 --batches 3000
    ;;
cuda)
    machine
    jstep bench_cuda 240 "$PY" -m shmloader bench --device cuda --workloads tiny,image,big --workers 2,8 --repeat 3 --json
    jstep bench_train 300 "$PY" -m shmloader bench --train --json
    ;;
*)
    echo "usage: bash benchmarks/gpu_host.sh tests|scale|cuda" >&2
    exit 2
    ;;
esac
