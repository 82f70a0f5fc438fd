#!/bin/bash
{{about}}
set -euo pipefail

submit() {
    sbatch --parsable "$@" <<'HPCDL_CHAIN_JOB'
{{job}}
HPCDL_CHAIN_JOB
}

previous=""
for k in $(seq 1 {{count}}); do
    id="$(submit ${previous:+"--dependency=afterany:$previous"} "$@")"
    previous="${id%%;*}"  # --parsable prints ID or ID;CLUSTER
    echo "hpcdl: chain job $k/{{count}}: $previous"
done
