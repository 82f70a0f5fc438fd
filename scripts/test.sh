#!/usr/bin/env bash
# Create/refresh the environment and run the whole test suite:
#   1. ruff (lint and format check)   2. pytest, single-process tests (includes the real-Slurm tests)
#   3. pytest under `mpirun -np 2` for the tests marked mpi
#   4. the tests marked torchvision, in .venv-torchvision (scripts/torchvision-tests.sh)
# Extra arguments go to both pytest runs (e.g. -x, -k name).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"

echo "== ruff"
ruff check hpcdl tests tools scripts
ruff format --check hpcdl tests tools scripts

# .venv-torchvision's 5.5 GB install is mostly disk and unzip: it runs beside the first stages
tv_log="$(mktemp)"
bash "$REPO/scripts/torchvision-tests.sh" --prepare >"$tv_log" 2>&1 &
tv_prepare=$!

echo "== pytest (single process)"
status=0
# --durations: the slowest tests, where CI's time goes (keep it under about 35 minutes)
python -m pytest -m "not mpi and not torchvision" --durations=25 "$@" tests || status=$?

echo "== pytest under mpirun -np 2 (tests marked mpi)"
mpi_status=0
mpirun -np 2 python -m pytest --with-mpi -m mpi -q -p no:cacheprovider --durations=10 "$@" tests ||
    mpi_status=$?

echo "== pytest with torchvision (torch 2.14.1 + torchvision 0.29.1 in .venv-torchvision)"
tv_status=0
wait "$tv_prepare" || cat "$tv_log" # a failed preparation is tried again, in the foreground
bash "$REPO/scripts/torchvision-tests.sh" -q "$@" || tv_status=$?

if [ "$status" -ne 0 ] || [ "$mpi_status" -ne 0 ] || [ "$tv_status" -ne 0 ]; then
    echo "hpcdl: tests FAILED (single-process exit $status, MPI exit $mpi_status," \
        "torchvision exit $tv_status)" >&2
    exit 1
fi
echo "hpcdl: all tests passed"
