#!/usr/bin/env bash
# Tests on the GPU machine: the GPU-only tests (NCCL, CUDA offload), then optionally the CPU
# suite under that machine's torch (2.11 there, 2.13 in CI), with results in $OUT.
#
#   bash bench/gpu_checks.sh                 # GPU tests only
#   CPU_SUITE=1 bash bench/gpu_checks.sh     # and the CPU suite (pytest-xdist, WORKERS=8 workers)
#   GPU_TESTS=tests/test_gpu.py CPU_TESTS=tests/test_train.py ...   # subsets of either
#   FCZERO_GPU_RANKS=4 bash bench/gpu_checks.sh   # the NCCL tests over 4 GPUs (default 2)
#
# The machine has no package registry: test-only packages come as wheels carried in .whl/
# (expecttest at the top, transformers and pytest-xdist with their needs in .whl/hf/), installed
# into a private folder put on PYTHONPATH after the repo; wheels the machine's Python already
# has a package for are left out, so nothing it ships is shadowed.
set -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out/checks}"
CPU_SUITE="${CPU_SUITE:-0}"
GPU_TIMEOUT="${GPU_TIMEOUT:-540}"  # the whole GPU set took longer than 300 s on a cold H100
CPU_TIMEOUT="${CPU_TIMEOUT:-420}"
WORKERS="${WORKERS:-8}"
GPU_TESTS="${GPU_TESTS:-tests}"  # a subset of test files, to rerun a few
CPU_TESTS="${CPU_TESTS:-tests}"  # likewise for the CPU suite (a file, or file::test ids)
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

wheels=()
for whl in .whl/expecttest-*.whl .whl/hf/*.whl; do
    [ -e "$whl" ] || continue
    module=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    case "$module" in pyyaml) module=yaml ;; pytest_xdist) module=xdist ;; esac
    python3 -c "import $module" 2>/dev/null || wheels+=("$whl")
done
if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/testsite "${wheels[@]}" \
        2>&1 | tail -3 | tee -a "$OUT/env.txt"
fi
export PYTHONPATH="$PWD:/tmp/testsite:${PYTHONPATH:-}"

{
    date -u
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
    python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
    echo "installed from .whl: ${wheels[*]:-none}"
} 2>&1 | tee -a "$OUT/env.txt"

status=0
timeout "$GPU_TIMEOUT" python3 -m pytest -v -rA --durations=0 -m gpu -p no:cacheprovider $GPU_TESTS 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -25
[ "${PIPESTATUS[0]}" -ne 0 ] && status=1

if [ "$CPU_SUITE" = 1 ]; then
    timeout "$CPU_TIMEOUT" python3 -m pytest -v -m "not gpu" -n "$WORKERS" -p no:cacheprovider -p no:benchmark $CPU_TESTS 2>&1 \
        | tee "$OUT/cpu_suite.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -40
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
fi
exit $status
