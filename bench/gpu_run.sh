#!/usr/bin/env bash
# The whole benchmark on the GPU machine: regime C, then regime M, every arm, results in $OUT.
#
#   bash bench/gpu_run.sh                       # from the repo root; .whl/ carried for DeepSpeed
#   ARMS=core STEPS=10 bash bench/gpu_run.sh    # trim: ARMS/SKIP take names or groups (bench/arms.py)
#
# Knobs (environment): OUT (default out/gpu), NPROC (2), ARMS (all), SKIP (""), REGIMES ("C M"),
# STEPS (10 timed), WARMUP (5; DeepCompile takes 8), ARM_TIMEOUT (180 s), PROFILE (0; 1 adds a
# torch.profiler trace per arm, tarred into traces.tgz). Extra arguments go to bench.run;
# pass --commit: a copied tree's git may be stale, and results.md records the commit given.
# Each regime is its own torchrun, so a regime that dies leaves the other's results; every arm's
# JSON line is written as soon as it finishes. Files in $OUT: results.jsonl, results.md,
# results.png, log_C.txt, log_M.txt, env.txt (and traces.tgz with PROFILE=1).
set -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out/gpu}"
NPROC="${NPROC:-2}"
ARMS="${ARMS:-all}"
SKIP="${SKIP:-}"
REGIMES="${REGIMES:-C M}"
STEPS="${STEPS:-10}"
WARMUP="${WARMUP:-5}"
ARM_TIMEOUT="${ARM_TIMEOUT:-180}"
PROFILE="${PROFILE:-0}"
mkdir -p "$OUT"

# NVLink multicast must stay off on these shared hosts; DeepSpeed's op builder needs a plain arch.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0
export PYTHONUNBUFFERED=1

# Benchmark-only packages (DeepSpeed and its needs), carried as wheels: never fczero's own deps.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH \
        || echo "gpu_run: installing .whl/ failed; the DeepSpeed arms will report it" | tee -a "$OUT/env.txt"
fi
export PYTHONPATH="$PWD:$PYTHONPATH"

{
    date -u
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    python3 -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' 2>&1 | tail -1
} 2>&1 | tee -a "$OUT/env.txt"

extra=()
[ "$PROFILE" = 1 ] && extra+=(--profile)
status=0
for regime in $REGIMES; do
    echo "gpu_run: regime $regime, arms $ARMS (skip: ${SKIP:-none})" | tee -a "$OUT/env.txt"
    torchrun --standalone --nproc-per-node "$NPROC" -m bench.run \
        --regimes "$regime" --arms "$ARMS" --skip "$SKIP" --steps "$STEPS" --warmup "$WARMUP" \
        --arm-timeout "$ARM_TIMEOUT" --out "$OUT" "${extra[@]}" "$@" 2>&1 | tee "$OUT/log_$regime.txt"
    rc=$?
    [ $rc -ne 0 ] && echo "gpu_run: regime $regime exited with $rc (see log_$regime.txt)" && status=$rc
done

python3 -m bench.report --out "$OUT" || status=$?
if [ "$PROFILE" = 1 ] && [ -d "$OUT/traces" ]; then
    tar czf "$OUT/traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
fi
exit $status
