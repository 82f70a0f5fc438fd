#!/bin/bash
# The staging-time formula change (issue 37, one formula): compare two capture dirs of
# dry_run.sh, masking what may change and nothing else: the time estimate (est_seconds, "~N s"),
# and where --epochs is left out (the default became hpcdl.train's), the whole-run figures.
# usage: dry_compare_formula.sh BEFORE AFTER
norm() {
  local cmd=$(cat "${1%.*}.cmd" 2>/dev/null)
  local sedargs=(-E -e 's/"capacity": [0-9]+/"capacity": N/g; s/fits in [0-9.]+ GB/fits in N GB/g'
                 -e 's/"est_seconds": [0-9.]+/"est_seconds": T/g; s/~[0-9.]+ s at/~T s at/g')
  if [[ "$1" == *.out && "$cmd" != *--epochs* ]]; then
    sedargs+=(-e 's/whole run of [0-9]+ epochs/whole run of E epochs/g'
              -e 's/"run_(files|bytes|fits)": [a-z0-9]+/"run_\1": R/g; s/\(run: [^)]*\)/(run: R)/g')
  fi
  sed "${sedargs[@]}" "$1"
}
rc=0
for f in $1/*; do
  b=$(basename $f)
  if ! diff <(norm $f) <(norm $2/$b) >/dev/null; then echo "DIFF $b"; diff <(norm $f) <(norm $2/$b) | head; rc=1; fi
done
echo "compared $(ls $1 | wc -l) files, masking the estimate and the default-epochs figures: rc=$rc"
