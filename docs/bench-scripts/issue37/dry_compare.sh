#!/bin/bash
# compare two capture dirs, masking only the free-disk-dependent default capacity
norm() { sed -E 's/"capacity": [0-9]+/"capacity": N/g; s/fits in [0-9.]+ GB/fits in N GB/g' "$1"; }
rc=0
for f in $1/*; do b=$(basename $f); if ! diff <(norm $f) <(norm $2/$b) >/dev/null; then echo "DIFF $b"; diff <(norm $f) <(norm $2/$b) | head; rc=1; fi; done
echo "compared $(ls $1 | wc -l) files rc=$rc"
