#!/usr/bin/env bash
# GPU validation (docs/PERFORMANCE.md, "GPU"): run on a node with an NVIDIA GPU, inside an
# environment where hpcdl, CuPy, mpi4py and (for the comparison) PyTorch import. Results go to
# stdout and, as JSON lines, to ${1:-gpu-check}/. Not part of CI: CI has no GPU.
#   1. the GPU-marked tests (gradient checks on CuPy, device batches)
#   2. compute benchmark vs PyTorch on the same GPU (cnn 3x32x32 and resnet20)
#   3. hpcdl.train on the GPU: 1 rank, then 2 and 4 ranks sharing it (host-staged allreduce)
#   4. the loader's asynchronous host-to-device overlap
set -euo pipefail
OUT="${1:-gpu-check}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== GPU tests"
status=0
python -m pytest -q -rfs --tb=short -m gpu -p no:cacheprovider tests >"$OUT/tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tests.log" || true

echo "== compute benchmark vs PyTorch (GPU)"
for spec in "cnn 64 3,32,32" "cnn 256 3,32,32" "resnet20 128 3,32,32"; do
    set -- $spec
    python -m hpcdl.bench compute --device gpu --model "$1" --batch-size "$2" \
        --input-shape "$3" --steps 50 --json | tail -1 | tee -a "$OUT/compute.jsonl"
done

echo "== hpcdl.train on the GPU (digits, cnn)"
DATA="$(mktemp -d)/digits"
python -m hpcdl.data convert digits "$DATA" --shard-size 200 >/dev/null
for np_ in 1 2 4; do
    rm -f "$OUT/train-$np_.jsonl"
    mpirun -np "$np_" python -m hpcdl.train --device gpu --data "$DATA/train" \
        --val-data "$DATA/val" --model cnn --epochs 15 --batch-size 32 --optimizer adam \
        --lr 0.001 --workers 1 --quiet --stage-dir "$DATA/../stage-$np_" \
        --metrics "$OUT/train-$np_.jsonl"
    tail -1 "$OUT/train-$np_.jsonl"
done

echo "== loader host-to-device overlap"
python -m hpcdl.bench loader --data "$DATA/jpegs" --make-jpegs 512 --max-images 512 \
    --workers 4 --device gpu --json | tail -1 | tee "$OUT/loader.json"
exit "$status"
