#!/usr/bin/env bash
# The tests marked `torchvision` (--model torchvision:NAME), in a second environment.
#
# The test venv (.venv, scripts/env.sh) holds the CPU build of torch 2.13.0, which has no
# torchvision beside it on this machine's disk or on PyPI. torchvision 0.29.1 comes with torch
# 2.14.1, a 5.5 GB CUDA build that runs on the CPU too. So these few tests get their own venv,
# .venv-torchvision, which holds only that pair (and numpy and Pillow at .venv's versions) and
# reaches everything else (hpcdl's editable install, mpi4py, h5py, pytest) through a .pth line
# that adds .venv's site-packages after its own: torch 2.14.1 shadows 2.13.0, nothing is built
# twice. mpi4py finds the wheel's Open MPI through LD_LIBRARY_PATH. Extra arguments go to pytest;
# `--prepare` alone only makes the venv (scripts/test.sh does that beside the other stages).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
TV="${HPCDL_TORCHVISION_VENV:-$REPO/.venv-torchvision}"
PAIR=(torch==2.14.1 torchvision==0.29.1)

site_of() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
pins="$("$VENV/bin/python" -c "import numpy, PIL; print(f'numpy=={numpy.__version__} pillow=={PIL.__version__}')")"
wanted="$(printf '%s\n' "${PAIR[@]}" "$pins" "$(site_of "$VENV")" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$TV/bin/python" ]; then
    "$PY" -m venv "$TV"
fi
if [ "$(cat "$TV/.hpcdl-inputs" 2>/dev/null)" != "$wanted" ]; then
    rm -f "$TV/.hpcdl-inputs"
    # shellcheck disable=SC2086 # $pins is two requirements
    "$TV/bin/python" -m pip install -q "${PAIR[@]}" $pins 2>&1 | { grep -v "^WARNING: Location" || true; }
    echo "import site; site.addsitedir('$(site_of "$VENV")')" >"$(site_of "$TV")/zz-hpcdl-test-venv.pth"
    echo "$wanted" >"$TV/.hpcdl-inputs"
fi
[ "${1:-}" = "--prepare" ] && exit 0
export LD_LIBRARY_PATH="$VENV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$TV/bin/python" -c "import torchvision, hpcdl, mpi4py.MPI" || {
    echo "hpcdl: $TV cannot import torchvision, hpcdl and mpi4py together (see above)" >&2
    exit 1
}
PATH="$TV/bin:$PATH" exec "$TV/bin/python" -m pytest -m torchvision -p no:cacheprovider "$@" tests
