#!/usr/bin/env bash
# The one-GPU benchmark (world size 1): fczero's own cost against the compute-only floor,
# with and without CUDA graphs, per phase (host vs GPU), in one regime. Results in $OUT.
#
#   REGIME=M bash bench/gpu_one.sh                 # from the repo root, on a machine with a GPU
#   BASE=.base BASE_COMMIT=1ea6d0e REGIME=M bash bench/gpu_one.sh
#
# Knobs (environment): OUT (default out/gpu-one), REGIME (M or C), ARMS (default: the floor
# and fczero, eager and compiled, each with CUDA graphs where it has them, and FSDP2 eager
# and compiled per block), STEPS (10), WARMUP (4), ARM_TIMEOUT (240 s), COMMIT (the commit to
# print; default git rev-parse, which a copied tree may not know). BASE names a folder
# holding an earlier checkout (git archive of BASE_COMMIT): its fczero arms (BASE_ARMS) run
# in the same call, after the others, so before and after come from one machine.
set -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out/gpu-one}"
REGIME="${REGIME:-M}"
ARMS="${ARMS:-floor,floor-cudagraphs,fsdp2-eager,fsdp2-compiled,fczero-eager,fczero-compiled,fczero-cudagraphs}"
BASE_ARMS="${BASE_ARMS:-fczero-eager,fczero-compiled}"
STEPS="${STEPS:-10}"
WARMUP="${WARMUP:-4}"
ARM_TIMEOUT="${ARM_TIMEOUT:-240}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # absolute: the base run works in another folder
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/env.txt"

status=0
TORCH_LOGS=perf_hints python3 -m bench.run --nproc 1 --regimes "$REGIME" --arms "$ARMS" \
    --steps "$STEPS" --warmup "$WARMUP" --arm-timeout "$ARM_TIMEOUT" --phases \
    --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
    --out "$OUT/now" --fresh > "$OUT/log_now.txt" 2>&1 || status=$?
grep -i "skipping cudagraphs" "$OUT/log_now.txt" | head -5
cat "$OUT/now/results.md"

if [ -n "${BASE:-}" ]; then
    (cd "$BASE" && PYTHONPATH="$PWD" torchrun --standalone --nproc-per-node 1 -m bench.run \
        --regimes "$REGIME" --arms "$BASE_ARMS" --steps "$STEPS" --warmup "$WARMUP" \
        --arm-timeout "$ARM_TIMEOUT" --phases --commit "${BASE_COMMIT:-base}" --out "$OUT/base" \
        --fresh) > "$OUT/log_base.txt" 2>&1 || status=$?
    cat "$OUT/base/results.md"
fi
exit $status
