#!/usr/bin/env bash
# Install the Slurm and munge Debian packages the `slurm`-marked tests need (a single-host
# slurmctld + slurmd + munged started by tests/slurm_cluster.py). Idempotent and quiet:
# does nothing when the binaries are already there. Needs root (or sudo) and apt-get.
# The packages' own services are NOT started or enabled here; the test harness runs private
# daemons with a generated slurm.conf and removes their state afterwards.
set -euo pipefail

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
# srun --mpi=pmix: Slurm's mpi/pmix plugin dlopens pmix2/lib/libpmix.so, which only the -dev
# package provides (tests/test_jobs_slurm_nodes.py launches with it across two nodes).
compgen -G "/usr/lib/*/pmix2/lib/libpmix.so" >/dev/null || need+=(libpmix-dev)
if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm.sh: missing ${need[*]} and no apt-get; install slurm-wlm and munge" \
        "with this system's package manager, or set HPCDL_NO_SLURM=1 to skip the Slurm tests" >&2
    exit 1
fi

SUDO=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "install-slurm.sh: need root (or sudo) to apt-get install slurm-wlm munge" >&2
        exit 1
    fi
fi

echo "install-slurm.sh: installing slurm-wlm munge libpmix-dev (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d exit 101 keeps package scripts from starting system services in containers;
# restore whatever was there before.
policy=/usr/sbin/policy-rc.d
saved=""
if [ -e "$policy" ]; then
    saved="$(mktemp)"
    "${SUDO[@]}" cp -p "$policy" "$saved"
fi
restore_policy() {
    if [ -n "$saved" ]; then
        "${SUDO[@]}" cp -p "$saved" "$policy"
        rm -f "$saved"
    else
        "${SUDO[@]}" rm -f "$policy"
    fi
}
trap restore_policy EXIT
printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
"${SUDO[@]}" chmod 0755 "$policy"

log="$(mktemp)"
if ! { "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq \
    --no-install-recommends slurm-wlm munge libpmix-dev; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "install-slurm.sh: apt-get install slurm-wlm munge failed (output above)" >&2
    exit 1
fi
rm -f "$log"

for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || {
        echo "install-slurm.sh: $bin still missing after installing slurm-wlm munge" >&2
        exit 1
    }
done
echo "install-slurm.sh: $(slurmctld -V) and munge installed"
