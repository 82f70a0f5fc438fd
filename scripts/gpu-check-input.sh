#!/usr/bin/env bash
# Issue 48's goal rows in one call (docs/PERFORMANCE.md, "Issue 48"): the step alone, torch's
# DataLoader (pin_memory, persistent workers, prefetch_factor 2 and 4) and hpcdl.torch.Loader
# with its default slots, at 8 and at 15 workers; then hpcdl.torch.Loader with decode="gpu" and
# 2 workers, and that decoding alone (the `decoder` row: decode_images_per_s is nvImageCodec
# alone, images_per_s with the crops). torchvision's resnet50 bf16, batch 128, on one JPEG
# folder made once: 6,400 JPEGs of 500x375 (the issue's own; about 120 KB each, written by one
# process per core in ~5 s), so 50 batches an epoch, and each row times 50 steps after 6: one
# epoch boundary in 56 steps, as in training, not one every 6. Last, the goal's hpcdl.train row:
# hpcdl's own resnet50 step alone (`bench compute`), then `hpcdl.train --decode gpu` with 2
# workers on the same folder, both with --gpu-kernels on a GPU (rows named so), 56 steps (its rate: steps 7-56, the epoch boundary at 50 among
# them, as the rows above time theirs; scripts/gpu_check_train_rows.py turns the two into rows
# loader none / hpcdl.train).
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
    COMMON=(--device gpu --data "$JPEGS" --make-jpegs 6400 --image-size 500x375
        --batch-size 128 --steps 50 --warmup 6)
    WORKERS=8,15
    # --gpu-kernels: the plain step's 0.14-0.18x is known from two lends; what the fast path
    # reaches end to end is the question left (scripts/gpu_check_train_rows.py names it)
    OWN=(--model resnet50 --batch-size 128 --precision bf16 --gpu-kernels)
    OWN_SHAPE=3,224,224 OWN_AUGMENT=rrc224+flip OWN_STEPS=10 OWN_TRAIN=(--epochs 2 --max-steps 56)
else  # the same rows, small: checks the script, not the speed
    COMMON=(--device cpu --data "$JPEGS" --make-jpegs 48 --image-size 160x120 --batch-size 8
        --augment rrc64+flip --steps 3 --warmup 1 --model sleep:5)
    WORKERS=2,3
    OWN=(--model resnet18 --batch-size 8 --precision fp32)
    OWN_SHAPE=3,64,64 OWN_AUGMENT=rrc64+flip OWN_STEPS=2 OWN_TRAIN=(--epochs 2 --max-steps 9)
fi
rc=0
LOG="$OUT/input.log"
# the device's name for the rows made below; here, not after the training run: a phase cut
# while torch imports would lose the end-to-end row that run made
NAME=cpu
[ "$DEVICE" = gpu ] && NAME="$("$PY" -c "import torch; print(torch.cuda.get_device_name())")"
run() {
    printf '%s\n' "$*" >>"$OUT/input-commands.txt"
    timeout -k 5 "$LIMIT" "$@" >>"$LOG" 2>&1 || rc=$?
}
ROWS=none,dataloader,hpcdl
for workers in ${WORKERS//,/ }; do  # one call per worker count: a time limit cuts one, not both
    run "$PY" -m hpcdl.bench input "${COMMON[@]}" --workers "$workers" --rows "$ROWS" \
        --json "$OUT/input.jsonl"
    ROWS=dataloader,hpcdl
done
run "$PY" -m hpcdl.bench input "${COMMON[@]}" --workers 2 --rows hpcdl-gpu,decoder \
    --json "$OUT/input.jsonl"
LOG="$OUT/input-own-step.log"
run "$PY" -m hpcdl.bench compute --device "$DEVICE" "${OWN[@]}" --input-shape "$OWN_SHAPE" \
    --steps "$OWN_STEPS" --no-torch --json
LOG="$OUT/input-train.log"
rm -f "$OUT/input-train.jsonl"
run mpirun -np 1 "$PY" -m hpcdl.train --device "$DEVICE" --decode gpu --workers 2 --data "$JPEGS" \
    --augment "$OWN_AUGMENT" "${OWN_TRAIN[@]}" "${OWN[@]}" --seed 0 --metrics-every 1 \
    --metrics "$OUT/input-train.jsonl"
LOG="$OUT/input.log"
run "$PY" scripts/gpu_check_train_rows.py "$OUT/input-own-step.log" "$OUT/input-train.jsonl" \
    "$OUT/input-train.log" "$OUT/input.jsonl" 2 "$NAME"
grep "images/s" "$OUT/input.log"
exit "$rc"
