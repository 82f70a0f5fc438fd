#!/usr/bin/env bash
# Issue 48's goal rows in one call (docs/PERFORMANCE.md, "Issue 48"): the step alone, torch's
# DataLoader (pin_memory, persistent workers, prefetch_factor 2 and 4) and hpcdl.torch.Loader
# with its default slots, at 8 and at 15 workers; then hpcdl.torch.Loader with decode="gpu" and
# 2 workers, and that decoding alone (the `decoder` row: decode_images_per_s is nvImageCodec
# alone, images_per_s with the crops). torchvision's resnet50 bf16, batch 128, on one JPEG
# folder made once.
#
#   bash scripts/gpu-check-input.sh OUT [DEVICE]       # DEVICE gpu (default) or cpu (a try here)
#
# Writes OUT/input.jsonl (one line per row: loader, decode, workers, slots, slots_default, batch,
# model, precision, images_per_s, data_wait_share, device), OUT/input.log and OUT/input-commands.txt.
# scripts/gpu-check.sh runs it as its input phase. Env: PY (interpreter, default python3),
# INPUT_JPEGS (the folder, default a temporary one), INPUT_TIMEOUT (seconds per command, 200).
set -uo pipefail
OUT="$(mkdir -p "${1:?usage: gpu-check-input.sh OUT [gpu|cpu]}" && cd "$1" && pwd)"
DEVICE="${2:-gpu}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PY:-python3}"
LIMIT="${INPUT_TIMEOUT:-200}"
if [ -n "${INPUT_JPEGS:-}" ]; then
    JPEGS="$INPUT_JPEGS"
else
    TMP_JPEGS="$(mktemp -d /tmp/hpcdl-input.XXXXXX)"
    trap 'rm -rf "$TMP_JPEGS"' EXIT
    JPEGS="$TMP_JPEGS/jpegs"
fi
if [ "$DEVICE" = gpu ]; then
    COMMON=(--device gpu --data "$JPEGS" --make-jpegs 2048 --image-size 448 --batch-size 128
        --steps 40 --warmup 5)
    WORKERS=8,15
else  # the same rows, small: checks the script, not the speed
    COMMON=(--device cpu --data "$JPEGS" --make-jpegs 48 --image-size 128 --batch-size 8
        --augment rrc64+flip --steps 3 --warmup 1 --model sleep:5)
    WORKERS=2
fi
rc=0
run() {
    printf '%s\n' "$*" >>"$OUT/input-commands.txt"
    timeout -k 5 "$LIMIT" "$@" >>"$OUT/input.log" 2>&1 || rc=$?
}
run "$PY" -m hpcdl.bench input "${COMMON[@]}" --workers "$WORKERS" --rows none,dataloader,hpcdl \
    --json "$OUT/input.jsonl"
run "$PY" -m hpcdl.bench input "${COMMON[@]}" --workers 2 --rows hpcdl-gpu,decoder \
    --json "$OUT/input.jsonl"
grep "images/s" "$OUT/input.log"
exit "$rc"
