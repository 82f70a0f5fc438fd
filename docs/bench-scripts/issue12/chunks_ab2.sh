#!/bin/bash
# bench compute, 2 threads: threads = chunks on 2 threads + 1-thread BLAS (branch), before = main HEAD archive.
cd /work/wt-chunks && export PATH=/work/wt-chunks/.venv/bin:$PATH
model=$1; rounds=$2; steps=$3
for r in $(seq $rounds); do
  for v in threads before; do
    if [ $v = threads ]; then P="python /tmp/chunks_bench2.py"; else P="python /tmp/chunks_runbefore.py -m hpcdl.bench compute"; fi
    l0=$(cut -d' ' -f1 /proc/loadavg)
    out=$($P --model $model --batch-size 64 --steps $steps --chunk 5 --json 2>/dev/null | tail -1)
    echo "$(date +%H:%M:%S) $v $model load $l0 $out"
  done
done
