#!/usr/bin/env bash
# Install the Debian packages that the build, tests and benchmarks need beyond Slurm:
# libssl-dev (OpenSSL 3's libcrypto and headers: the stager's peer handshake and MACs; the build
# needs it) and fuse3 (fusermount3 and libfuse3 for the slow read-only FUSE file system,
# tools.bench.slowfs). Idempotent and quiet: does nothing when they are there. Without root or
# apt-get it says so and exits 0: the FUSE tests then skip with one reason, and the build names
# the missing OpenSSL.
set -euo pipefail

need=()
[ -f /usr/include/openssl/hmac.h ] || need+=(libssl-dev)
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "install-system.sh: need root (or sudo) to apt-get install ${need[*]};" \
            "without them the FUSE tests skip and hpcdl-stage does not build" >&2
        exit 0
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system.sh: no apt-get to install ${need[*]}; without them the FUSE tests" \
        "skip and hpcdl-stage does not build" >&2
    exit 0
fi
echo "install-system.sh: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if ! { "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq \
    --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "install-system.sh: apt-get install ${need[*]} failed (output above)" >&2
    exit 1
fi
rm -f "$log"
