#!/usr/bin/env bash
# The one-GPU capacity run on the GPU machine, in calls that each fit 10 minutes.
#
#   CALL=speed   bash bench/gpu_capacity.sh   # 4 and 20 layers: every peer arm and fczero's
#   CALL=largest bash bench/gpu_capacity.sh   # FSDP2's largest (22-24 layers), fczero at 44
#   CALL=peers   bash bench/gpu_capacity.sh   # the offload peers near their host bounds:
#                                             # 23 layers (DeepSpeed), 32 (FSDP2 CPUOffloadPolicy)
#
# Run from the repo root with .whl/ carried (DeepSpeed and its needs). Each call writes
# capacity.md, capacity.jsonl and a tarball of its bench.run folders into $OUT; merge the
# calls with `python -m bench.capacity --merge A B --out BOTH`.
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu-capacity}"
CALL="${CALL:-speed}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
work=/tmp/capacity-$CALL
status=0
case "$CALL" in
speed)
    python3 -m bench.capacity --layers 4,20 --budget "${BUDGET:-540}" --arm-timeout 200 \
        --arms fsdp2-eager,fsdp2-cpuoffload,fczero-adaptive-eager,fczero-adaptive,deepspeed-offload \
        --max-layers fczero-adaptive=4 --out "$work" > "$OUT/log_$CALL.txt" 2>&1 || status=$?
    ;;
largest)
    python3 -m bench.capacity --layers 22,23,24 --arms fsdp2-eager --budget 200 \
        --out "$work/fsdp2" > "$OUT/log_$CALL.txt" 2>&1 || status=$?
    python3 -m bench.capacity --layers "${LARGEST:-44}" --arms fczero-adaptive-eager \
        --budget 330 --arm-timeout 300 --out "$work/fczero" >> "$OUT/log_$CALL.txt" 2>&1 || status=$?
    python3 -m bench.capacity --merge "$work/fsdp2" "$work/fczero" --out "$work" \
        >> "$OUT/log_$CALL.txt" 2>&1 || status=$?
    ;;
peers)
    python3 -m bench.capacity --layers 23 --arms fsdp2-eager,fczero-adaptive-eager,deepspeed-offload \
        --budget 300 --arm-timeout 200 --out "$work/near23" > "$OUT/log_$CALL.txt" 2>&1 || status=$?
    python3 -m bench.capacity --layers 32 --arms fsdp2-cpuoffload,fczero-adaptive-eager \
        --budget 270 --arm-timeout 240 --out "$work/near32" >> "$OUT/log_$CALL.txt" 2>&1 || status=$?
    python3 -m bench.capacity --merge "$work/near23" "$work/near32" --out "$work" \
        >> "$OUT/log_$CALL.txt" 2>&1 || status=$?
    ;;
*) echo "CALL must be speed, largest or peers, got $CALL" >&2; exit 2 ;;
esac
cp "$work/capacity.md" "$work/capacity.jsonl" "$OUT/" 2>/dev/null
tar czf "$OUT/runs_$CALL.tgz" -C "$work" . 2>/dev/null
tail -n 40 "$OUT/log_$CALL.txt"
cat "$OUT/capacity.md" 2>/dev/null
exit $status
