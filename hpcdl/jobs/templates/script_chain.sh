#!/bin/bash
# A chain of {{count}} identical jobs running a user's training script for site {{site}},
# rendered by `python -m hpcdl.jobs render script ... --chain {{count}}`. Run it once:
# `bash THIS_FILE` (arguments are passed to every sbatch, e.g. `bash THIS_FILE --partition=long`).
#
# Job 1 is submitted now, job k+1 with --dependency=afterany:<job k>, so it starts when job k has
# ended, however it ended: stopped by its time-limit signal (hpcdl.torch.stop_requested()),
# finished, or failed. Every job runs the same command: the script itself resumes from its own
# latest checkpoint, and exits 0 at once when there is nothing left to train. To stop the chain:
# scancel the jobs it prints.
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
