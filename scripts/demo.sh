#!/usr/bin/env bash
# Create/refresh the environment and run the main job: 2 MPI ranks train the `cnn` model on the
# embedded digits data set, with node-local staging into a temporary stage directory.
# Extra arguments are passed to hpcdl.train (e.g. --epochs 3 --model mlp).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"

DATA="${HPCDL_DEMO_DATA:-$REPO/runs/digits}"
if [ ! -d "$DATA/train" ]; then
    python -m hpcdl.data convert digits "$DATA" --shard-size 200
fi
RUN="$REPO/runs/demo"
mkdir -p "$RUN"
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/hpcdl-stage.XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT

mpirun -np 2 python -m hpcdl.train \
    --data "$DATA/train" --val-data "$DATA/val" \
    --model cnn --epochs 15 --batch-size 32 --optimizer adam --lr 0.001 --workers 1 \
    --stage-dir "$STAGE/stage" --metrics "$RUN/metrics.jsonl" "$@"
# hpcdl.train appends each run to the metrics file; hpcdl.report draws the last one.
echo "metrics: $RUN/metrics.jsonl (plot: python -m hpcdl.report $RUN/metrics.jsonl --out $RUN/report.png)"
