#!/bin/bash
# Alternate before (main 0cac432, /tmp/winograd-before) and after (worktree) bench compute runs.
cd /work/wt-winograd
PY=/work/wt-winograd/.venv/bin/python
OUT=${1:-/tmp/winograd/ab_bench.jsonl}
ROUNDS=${2:-3}
PRE=${3:-}
for round in $(seq $ROUNDS); do
  for model in resnet20 cnn; do
    steps=10; [ $model = cnn ] && steps=20
    for side in before after; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      if [ $side = before ]; then
        res=$(cd /tmp && $PRE $PY /tmp/winograd/runbefore.py -m hpcdl.bench compute --model $model --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
      else
        res=$($PRE $PY -m hpcdl.bench compute --model $model --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
      fi
      echo "{\"round\": $round, \"side\": \"$side\", \"model\": \"$model\", \"load\": $load, \"time\": \"$(date -u +%H:%M:%S)\", \"result\": $res}" >> $OUT
    done
  done
done
