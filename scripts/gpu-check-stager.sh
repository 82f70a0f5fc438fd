#!/usr/bin/env bash
# Build hpcdl-stage for scripts/gpu-check.sh on a machine that may lack OpenSSL 3's headers (a
# lent GPU machine has libcrypto.so.3, which its Python's ssl module loads, but no libssl-dev).
#
#   bash scripts/gpu-check-stager.sh BUILD_DIR [OPENSSL_DIR]
#
# OPENSSL_DIR, where given: the headers carried to the machine, either as Debian packages
# (libssl-dev_*.deb, and libssl3*.deb where the machine lacks libcrypto.so.3; unpacked with
# dpkg -x into BUILD_DIR/openssl) or as a tree with include/openssl/. The carried headers are
# compiled against the machine's own libcrypto.so.3 unless the tree brings one. Prints the
# binary's path on its last line and exits 0; else a last line "not built: WHY" and exits 1,
# or 0 where no headers were carried and there are none here (a run without the stager).
# STAGER_BUILD_TYPE: CMake's build type (default Release; gpu-check.sh's CPU dry run: None).
# Fetch the packages beside a checkout (not on the device: it has no network), e.g. on Ubuntu
# 24.04, the device image's base: `apt-get download libssl-dev`.
set -uo pipefail
BUILD="${1:?usage: gpu-check-stager.sh BUILD_DIR [OPENSSL_DIR]}"
CARRIED="${2:-}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$BUILD"
ARGS=()
ARCH_INCLUDE=""
if [ -n "$CARRIED" ]; then
    ROOT="$CARRIED"
    if compgen -G "$CARRIED/*.deb" >/dev/null; then
        ROOT="$BUILD/openssl"
        for deb in "$CARRIED"/*.deb; do dpkg -x "$deb" "$ROOT" || {
            echo "not built: dpkg -x $deb failed"
            exit 1
        }; done
        ROOT="$ROOT/usr"
    fi
    if [ ! -f "$ROOT/include/openssl/opensslv.h" ]; then
        echo "not built: $CARRIED holds no OpenSSL headers (include/openssl/opensslv.h)"
        exit 1
    fi
    # Debian keeps configuration.h under include/<multiarch>/openssl
    ARCH_INCLUDE="$(dirname "$(dirname "$(find "$ROOT/include" -path '*/openssl/configuration.h' | head -1)")")"
    LIB="$(find "$ROOT" -name 'libcrypto.so.3' 2>/dev/null | head -1)"
    [ -z "$LIB" ] && LIB="$(ldconfig -p 2>/dev/null | awk '/libcrypto\.so\.3 /{print $NF; exit}')"
    if [ -z "$LIB" ]; then
        echo "not built: no libcrypto.so.3 here nor in $CARRIED (carry libssl3's .deb too)"
        exit 1
    fi
    ARGS=(-DOPENSSL_ROOT_DIR="$ROOT" -DOPENSSL_INCLUDE_DIR="$ROOT/include"
        -DOPENSSL_CRYPTO_LIBRARY="$LIB")
fi
FLAGS="${ARCH_INCLUDE:+-isystem $ARCH_INCLUDE}"
if ! CXXFLAGS="$FLAGS" cmake -S . -B "$BUILD/build" -DCMAKE_BUILD_TYPE="${STAGER_BUILD_TYPE:-Release}" \
    "${ARGS[@]}" >"$BUILD/cmake.log" 2>&1; then
    if grep -q "needs OpenSSL 3" "$BUILD/cmake.log" && [ -z "$CARRIED" ]; then
        # none carried: a run without the stager, said so, is what was asked for (exit 0)
        echo "not built: no OpenSSL 3 headers here (carry libssl-dev's .deb: GPU_CHECK_OPENSSL)"
        exit 0
    else
        echo "not built: cmake failed (its output: $BUILD/cmake.log)"
    fi
    exit 1
fi
if ! cmake --build "$BUILD/build" --target hpcdl-stage -j "$(nproc)" >>"$BUILD/cmake.log" 2>&1; then
    echo "not built: the build failed (its output: $BUILD/cmake.log)"
    exit 1
fi
echo "$BUILD/build/hpcdl-stage"
