#!/usr/bin/env bash
# Several benches back to back on one device lease, started detached (setsid) so the GPU keeps
# working across the device tool's 10-minute command limit; later calls only wait and collect.
#
#   setsid nohup bash bench/gpu_session.sh /tmp/res STEPS_FILE </dev/null >/tmp/res.out 2>&1 &
#
# STEPS_FILE: one step per line, "name limit_s command ...", run in order from a copy of the
# checkout (the device tool re-sends the checkout on each call; a running bench must not see its
# files change underneath it). A step named "name&" runs beside the steps after it: one that
# times under the host's device lock, as bench/compile_truth.py does, beside a tune. Each step's
# output: RESULTS/name.log; the timeline: RESULTS/progress.log. `collect` packs what is small
# enough to come back into one archive.
# Make each next device call at once: a machine left idle for 30 s goes back, and the running
# chain and everything under RESULTS go with it (lost a traffic run on 2026-12-02).
set -u
res=${1:?results folder}
if [ "${2:-}" = collect ]; then
    cd "$res" && find . \( -path ./repo -o -name compile_cache \) -prune -o -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' \
        -o -name '*.md' -o -name '*.txt' -o -name '*.sqlite' -o -name '*.sqlite-wal' \) -size -4M -print | tar czf "${3:?archive}" -T -
    exit
fi
steps=${2:?steps file}
mkdir -p "$res"
rm -rf "$res/repo" && cp -a "$(dirname "$0")/.." "$res/repo" && cd "$res/repo" || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
step() {  # name limit cmd: one step, its output in RESULTS/name.log, its start and end in progress.log
    echo "[$(date +%T)] start $1 (limit ${2}s): $3" >>"$res/progress.log"
    local t0 rc
    t0=$(date +%s)
    # timeout signals the step's whole process group: a killed bench takes its workers along.
    timeout -k 15 "$2" bash -c "$3" >"$res/$1.log" 2>&1 </dev/null
    rc=$?
    echo "[$(date +%T)] end $1 rc=$rc after $(( $(date +%s) - t0 ))s" >>"$res/progress.log"
}
while read -r name limit cmd; do
    [ -z "$name" ] || [ "${name#\#}" != "$name" ] && continue
    if [ "${name%&}" != "$name" ]; then  # "name&": runs beside the steps after it
        step "${name%&}" "$limit" "$cmd" &
    else
        step "$name" "$limit" "$cmd"
    fi
done <"$steps"
wait
echo "[$(date +%T)] all steps done" >>"$res/progress.log"
