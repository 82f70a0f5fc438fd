# Sourced by scripts/*.sh: create or refresh .venv with hpcdl and the default MPI.
# HPCDL_VENV overrides the location; HPCDL_PYTHON the interpreter used to create it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HPCDL_VENV:-$REPO/.venv}"
PY="${HPCDL_PYTHON:-python3}"
EXTRAS="${HPCDL_EXTRAS:-test,mpi}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "hpcdl: creating $VENV"
    "$PY" -m venv "$VENV"
fi

# What the editable install is built from. Python edits need no reinstall (the install points
# at the checkout), but dependencies (pyproject.toml) and the C++ stager (CMakeLists.txt,
# staging/) do; so do another checkout path, other extras or another interpreter.
install_inputs_hash() {
    (
        cd "$REPO"
        printf '%s\n' "$REPO" "$EXTRAS" "$("$VENV/bin/python" -VV)"
        find pyproject.toml CMakeLists.txt staging -type f -print0 | sort -z | xargs -0 sha256sum
        # The editable install maps each module name to its file when it is made: a module that
        # becomes a package (or moves) needs a new install, so the module list counts too.
        find hpcdl -name '*.py' | sort
    ) | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.hpcdl-install-inputs"
wanted="$(install_inputs_hash)"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$wanted" ] && [ -x "$VENV/bin/hpcdl-stage" ] &&
    "$VENV/bin/python" -c "import hpcdl, mpi4py, h5py, numpy" 2>/dev/null; then
    : # installed from these inputs: skip pip (about 6 s)
else
    rm -f "$STAMP"
    # Quiet, but show errors. The editable install builds the C++ stager with CMake. A failed
    # install (offline, say) over a working one goes on with the old one and retries next time.
    "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
    installed=true
    "$VENV/bin/python" -m pip install -q -e "$REPO[$EXTRAS]" 2>&1 |
        { grep -v "^WARNING: Location" || true; } || installed=false
    "$VENV/bin/python" -c "import hpcdl, mpi4py, h5py, numpy" || {
        echo "hpcdl: installation into $VENV failed (see the pip output above)" >&2
        exit 1
    }
    if [ "$installed" = true ]; then
        echo "$wanted" >"$STAMP"
    fi
fi
export PATH="$VENV/bin:$PATH"
# Open MPI refuses to run as root unless told; containers and CI often run as root.
if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Oversubscription lets tests start more ranks than this machine has cores.
export OMPI_MCA_rmaps_base_oversubscribe=1
