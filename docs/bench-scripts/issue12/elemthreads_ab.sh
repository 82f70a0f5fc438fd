#!/bin/bash
# bench compute, before (main 6b8c148 archive) and after (worktree), alternated; last JSON lines.
cd /work/wt-elemthreads && export PATH=/work/wt-elemthreads/.venv/bin:$PATH HPCDL_NO_SLURM=1
out=/tmp/elemthreads_ab.jsonl; : > $out
for r in 1 2 3; do
  for m in cnn resnet20; do
    steps=20; [ $m = resnet20 ] && steps=10
    for side in after before; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      if [ $side = after ]; then
        line=$(python -m hpcdl.bench compute --model $m --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
      else
        line=$(python /tmp/elemthreads_runbefore.py -m hpcdl.bench compute --model $m --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
      fi
      echo "{\"round\": $r, \"side\": \"$side\", \"load\": $load, \"result\": $line}" >> $out
    done
  done
done
echo done >> $out
