#!/usr/bin/env bash
# Peak VmRSS and RssAnon of hpcdl-stage while a stage-only run stages DATA (issue 29).
# usage: stager_memory.sh DATA STAGE_DIR [CAPACITY]   (CAPACITY default 1G: stages ~1/10 of
# ImageNet-1k's 1.28 M names, enough for every per-file structure of the plan to exist)
set -euo pipefail
data=$1 stage=$2 cap=${3:-1G}
python -m hpcdl.stage --data "$data" --stage-dir "$stage" --stage-capacity "$cap" --quiet &
job=$!
peak_rss=0 peak_anon=0
while kill -0 "$job" 2>/dev/null; do
    for pid in $(pgrep -f "hpcdl-stage --stage-dir $stage" || true); do
        rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
        anon=$(awk '/^RssAnon/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
        [ "${rss:-0}" -gt "$peak_rss" ] && peak_rss=$rss
        [ "${anon:-0}" -gt "$peak_anon" ] && peak_anon=$anon
    done
    sleep 0.2
done
wait "$job"
echo "hpcdl-stage peak VmRSS $((peak_rss / 1024)) MiB, peak RssAnon $((peak_anon / 1024)) MiB"
