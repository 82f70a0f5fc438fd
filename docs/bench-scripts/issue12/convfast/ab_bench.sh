#!/bin/bash
# bench compute, before (main c5d9fe7 archive, /tmp/convfast-before) and after (worktree), alternated.
cd /work/wt-convfast && export PATH=/work/wt-convfast/.venv/bin:$PATH HPCDL_NO_SLURM=1
out=/tmp/convfast/ab_bench.jsonl; : > $out
for r in 1 2 3; do
  for m in resnet20 cnn; do
    steps=20; [ $m = resnet20 ] && steps=10
    for side in after before; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      if [ $side = after ]; then
        line=$(python -m hpcdl.bench compute --model $m --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
      else
        line=$(python /tmp/convfast/runbefore.py -m hpcdl.bench compute --model $m --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
      fi
      echo "{\"round\": $r, \"side\": \"$side\", \"load\": $load, \"result\": $line}" >> $out
    done
  done
done
echo done >> $out
