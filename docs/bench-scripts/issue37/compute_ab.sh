#!/bin/bash
# Needs the base unpacked first: git archive d47b063 hpcdl | tar -x -C /tmp/hh_base
# Back-to-back A/B of `bench compute` (cnn, batch 32, 3x32x32, 30 steps): base (d47b063) vs this branch, alternating order.
cd "$(dirname "$0")/../../.." && source scripts/env.sh >/dev/null 2>&1; set +eo pipefail
for i in 1 2 3 4 5 6; do
  if [ $((i % 2)) -eq 1 ]; then order="base mine"; else order="mine base"; fi
  for who in $order; do
    if [ $who = base ]; then cmd="python docs/bench-scripts/issue37/run_base.py"; else cmd="python -m hpcdl.bench"; fi
    ms=$($cmd compute --model cnn --batch-size 32 --input-shape 3,32,32 --steps 30 --no-torch 2>&1 | awk '/hpcdl +[0-9]/{print $2}')
    echo "$i $who $ms"
  done
done
uptime
