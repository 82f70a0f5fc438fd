#!/bin/bash
# A chain of {{count}} identical hpcdl training jobs for site {{site}}, rendered by
# `python -m hpcdl.jobs render train ... --chain {{count}}`. Run it once: `bash THIS_FILE`
# (arguments are passed to every sbatch, e.g. `bash THIS_FILE --partition=long`).
#
# Job 1 is submitted now, job k+1 with --dependency=afterany:<job k>, so it starts when job k
# has ended, however it ended: stopped by its time-limit signal after a checkpoint (exit 3),
# finished, or failed. Every job is the script below, with --resume auto: it continues from the
# latest checkpoint in {{checkpoint_dir}}; a job that finds the run finished says "nothing to
# train" and exits 0 at once. To stop the chain: scancel the jobs it prints.
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
