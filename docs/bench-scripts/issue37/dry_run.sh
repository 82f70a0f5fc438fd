#!/bin/bash
# Issue 37 deliverable 6: the dry run's outputs before and after, on fixed data sets.
# 1. python docs/bench-scripts/issue37/dry_make_data.py   (data under /tmp/hh_dry/data)
# 2. this script on the base commit and on the branch, into two folders
# 3. bash docs/bench-scripts/issue37/dry_compare.sh BEFORE AFTER (masks only the free-space capacity)
# usage: run.sh OUTDIR   (run from the worktree, its .venv)
out=$1; mkdir -p $out; D=/tmp/hh_dry/data
export XDG_CACHE_HOME=/tmp/hh_dry/cache
PY=${PY:-python}
i=0
while IFS= read -r line; do
  [ -z "$line" ] && continue
  i=$((i+1))
  eval "$PY -m hpcdl.stage $line" > $out/$i.out 2> $out/$i.err; echo $? > $out/$i.rc
  echo "$line" > $out/$i.cmd
done <<LIST
--dry-run --data $D/tree --files-only --nodes 3 --ranks-per-node 2 --batch-size 4 --seed 5 --epochs 3 --json
--dry-run --data $D/tree --files-only --nodes 3 --ranks-per-node 2 --batch-size 4 --seed 5 --epochs 3
--dry-run --data $D/tree --files-only --nodes 4 --ranks-per-node 2 --batch-size 4 --shuffle node --placement cyclic --stage-capacity 100000 --epochs 2
--dry-run --data $D/tree --files-only --nodes 2 --ranks-per-node 2 --batch-size 4 --pfs-open-latency 5 --pfs-bandwidth 200 --json
--dry-run --data $D/tree --files-only --calibration $D/cal.toml --nodes 1,2,4 --ranks-per-node 2 --batch-size 10 --epochs 2 --json
--dry-run --data $D/tree --files-only --calibration $D/cal.toml --nodes 1,2,4 --ranks-per-node 2 --batch-size 10 --epochs 2
--dry-run --calibration docs/calibrations/imagenet-lustre-a100.toml --dataset-files 1281167 --dataset-bytes 140e9 --nodes 8,1024 --ranks-per-node 8 --epochs 90 --json
--dry-run --calibration docs/calibrations/imagenet-lustre-a100.toml --dataset-files 1281167 --dataset-bytes 140e9 --nodes 8,1024 --ranks-per-node 8 --epochs 90
--dry-run --config $D/job.toml --json
--dry-run --config $D/job.toml --nodes 2 --ranks-per-node 2
--dry-run --data $D/folder --batch-size 2 --json
--dry-run --data $D/folder --augment rrc
--dry-run --data $D/digits/train --nodes 2 --ranks-per-node 2 --batch-size 8 --epochs 2
--dry-run --data $D/digits/train --nodes 2 --ranks-per-node 2 --batch-size 8 --epochs 2 --json
--dry-run --data $D/missing --files-only
--dry-run --data $D/tree --nodes 2,4
--dry-run --data $D/big --files-only --nodes 2 --batch-size 8 --epochs 1 --pfs-open-latency 1 --pfs-bandwidth 200 --json
LIST
