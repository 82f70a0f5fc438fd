#!/bin/bash
# One-thread CPU ms/step, before (main HEAD archive) and after (worktree), alternated.
cd /work/wt-chunks && export PATH=/work/wt-chunks/.venv/bin:$PATH OPENBLAS_NUM_THREADS=1
for r in 1 2 3; do
  for m in cnn resnet20; do
    python /tmp/chunks_cpu1.py $m 8
    python /tmp/chunks_runbefore.py /tmp/chunks_cpu1.py $m 8 2>/dev/null
  done
done
