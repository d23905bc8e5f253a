#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a machine with a CUDA device and torch installed:
# build and install pyshmckpt from this checkout, run the `gpu` tests, the staging tests under
# compute-sanitizer's memcheck, the device-to-host staging benchmark and the training overhead on
# the GPU; then the staging, native and package tests with a real driver present.
#
#   bash bench/gpu_checks.sh OUTDIR        # PYTHON=... to choose the interpreter
#
# Each step is bounded; OUTDIR receives one log per step (env.txt first: GPU, driver, versions).
set -uo pipefail
out=${1:?usage: bash bench/gpu_checks.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
# -P: the checkout's own (unbuilt) pyshmckpt must not shadow the installed one.
pytest=("$py" -P -m pytest -p no:cacheprovider -W default)
export PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT COMMAND...: run, log to OUTDIR/NAME, print its status and last lines
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
    tail -n 15 "$out/$name"
    return "$rc"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)'
    echo "cpus $(nproc), kernel $(uname -r)"
    git rev-parse --short HEAD 2>/dev/null
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

step build.log 240 "$py" -m pip install --no-build-isolation --no-deps . || exit 1
(cd /tmp && "$py" -m pyshmckpt cuda-info) >>"$out/env.txt" 2>&1
tail -n 12 "$out/env.txt"
step gpu-tests.log 120 "${pytest[@]}" -m gpu -v tests/staging/test_stager_gpu.py \
    tests/staging/test_arrays.py tests/test_arrays_checkpoint.py tests/test_memory_tier_gpu.py
step d2h.txt 150 "$py" bench/device_to_host.py
step sanitizer.log 180 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "${pytest[@]}" -q -x tests/staging/test_stager_gpu.py -k "not cannot_load"
step overhead.txt 180 "$py" bench/training_overhead.py --device cuda --width 768 --layers 6 \
    --vocab 16384 --seq-len 256 --batch-size 16 --steps 40 --every 5 20 --repeats 2
step other-tests.log 150 "${pytest[@]}" -q -n 8 tests/staging tests/native tests/test_package.py
