#!/usr/bin/env bash
# scripts/gpu-check.sh's last step: OUT packed into what a device call brings back (8 files at
# most, 16 MiB each, two folders deep; /work/.library/device/README.md's limits, as the device
# tool states them). OUT keeps summary.txt and env.txt; every file of OUT, those two included,
# goes into OUT/raw.tar.gz under its path in OUT, so that unpacking the archive into
# docs/gpu-runs/<date>-<commit>/ gives the folder as the run left it.
#
#   bash scripts/gpu-check-pack.sh OUT WORK LIMIT_BYTES
#
# Where the archive would pass LIMIT_BYTES, files are left out of it, largest first, timelines
# (raw/timeline-*) before anything else, never summary.txt or env.txt, until it fits; the last
# line printed names them. WORK: a scratch folder for the archive while it is made.
set -uo pipefail
OUT="${1:?usage: gpu-check-pack.sh OUT WORK LIMIT_BYTES}" WORK="${2:?}" LIMIT="${3:?}"
KEPT=(summary.txt env.txt)
(cd "$OUT" && find . -type f ! -path ./raw.tar.gz -printf '%s\t%P\n') | sort -rn >"$WORK/pack.list"
left_out=()
while :; do
    cut -f2- "$WORK/pack.list" >"$WORK/pack.names"
    tar -C "$OUT" -czf "$WORK/raw.tar.gz" -T "$WORK/pack.names" || exit 1
    size=$(stat -c %s "$WORK/raw.tar.gz")
    [ "$size" -le "$LIMIT" ] && break
    drop="$(awk -F'\t' '$2 ~ /^raw\/timeline-/ { print $2; exit }' "$WORK/pack.list")"
    [ -z "$drop" ] && drop="$(awk -F'\t' '$2 != "summary.txt" && $2 != "env.txt" { print $2; exit }' \
        "$WORK/pack.list")"
    if [ -z "$drop" ]; then
        echo "gpu-check-pack: raw.tar.gz is $((size / 1048576)) MiB with only ${KEPT[*]} in it"
        break
    fi
    left_out+=("$drop ($(($(stat -c %s "$OUT/$drop") / 1048576)) MiB)")
    awk -F'\t' -v drop="$drop" '$2 != drop' "$WORK/pack.list" >"$WORK/pack.kept"
    mv "$WORK/pack.kept" "$WORK/pack.list"
done
while read -r name; do
    case "$name" in summary.txt | env.txt) ;; *) rm -f "$OUT/$name" ;; esac
done < <(cd "$OUT" && find . -type f ! -path ./raw.tar.gz -printf '%P\n')
find "$OUT" -mindepth 1 -type d -empty -delete
mv "$WORK/raw.tar.gz" "$OUT/raw.tar.gz"
echo "raw.tar.gz: $(wc -l <"$WORK/pack.list") files, $((size / 1024)) KiB (unpack it into" \
    "docs/gpu-runs/<date>-<commit>/)"
if [ "${#left_out[@]}" -gt 0 ]; then
    echo "left out of raw.tar.gz (over $((LIMIT / 1048576)) MiB): ${left_out[*]}"
fi
