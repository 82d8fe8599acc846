#!/usr/bin/env bash
# Weak scaling on one machine: the same per-GPU batch on 2 GPUs, then on all of them (or the
# world sizes NPROCS names), then bench.scaling over the runs. Results in $OUT.
#
#   bash bench/gpu_scale.sh --commit abc1234        # from the repo root: 2 GPUs, then all
#   NPROCS="2 4 8" bash bench/gpu_scale.sh          # 2 -> 4 -> 8 on an 8-GPU machine
#   NPROCS="4 8" REGIMES=R8 bash bench/gpu_scale.sh --model llama3-8b --floor-layers 8
#       # Llama-3-8B (1 x 8192): its floor measured at 4 and 8 layers, scaled to 32; 4 GPUs at
#       # least (fp32 params, grads and AdamW states, 16 bytes a param: 60 GiB a GPU on 2)
#
# Knobs (environment): OUT (default out/gpu-scale), NPROCS (default "2 <GPUs here>"), ARMS
# (floor,fsdp2-compiled,fczero-compiled,fczero-cudagraphs), REGIMES ("M C"), and the rest of
# bench/gpu_run.sh's (SKIP, STEPS, WARMUP, ARM_TIMEOUT, PROFILE). Extra arguments go to bench.run
# through gpu_run.sh; pass --commit: a copied tree's git may be stale. World size N runs
# bench/gpu_run.sh on the first N GPUs (of CUDA_VISIBLE_DEVICES where it is set) into $OUT/nN;
# then `python -m bench.scaling` writes $OUT/scaling/ (scaling.md: tokens/s/GPU, weak-scaling
# efficiency, MFU and peak GiB per regime, arm and world size; scaling.json; scaling.png where
# matplotlib imports). A world size that fails leaves the others' results; the exit status is
# the last failure's.
set -o pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out/gpu-scale}"
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -ra ids <<< "$CUDA_VISIBLE_DEVICES"
else
    mapfile -t ids < <(seq 0 $(($(nvidia-smi -L | grep -c '^GPU') - 1)))
fi
NPROCS="${NPROCS:-$(printf '%s\n' 2 "${#ids[@]}" | sort -nu | tr '\n' ' ')}"
export ARMS="${ARMS:-floor,fsdp2-compiled,fczero-compiled,fczero-cudagraphs}"
export REGIMES="${REGIMES:-M C}"
mkdir -p "$OUT"

status=0
outs=()
for n in $NPROCS; do
    if [ "$n" -gt "${#ids[@]}" ]; then
        echo "gpu_scale: $n GPUs asked for, ${#ids[@]} here: skipped" && status=1 && continue
    fi
    devices="$(IFS=,; echo "${ids[*]:0:$n}")"
    echo "gpu_scale: $n GPUs ($devices), regimes $REGIMES, arms $ARMS -> $OUT/n$n"
    CUDA_VISIBLE_DEVICES="$devices" OUT="$OUT/n$n" NPROC="$n" bash bench/gpu_run.sh "$@" \
        || { status=$?; echo "gpu_scale: $n GPUs exited with $status"; }
    [ -s "$OUT/n$n/results.jsonl" ] && outs+=("$OUT/n$n")
done

if [ ${#outs[@]} -gt 0 ]; then
    python3 -m bench.scaling "${outs[@]}" --out "$OUT/scaling" || status=$?
else
    echo "gpu_scale: no results to compare" && status=1
fi
exit $status
