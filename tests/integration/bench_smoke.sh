#!/usr/bin/env bash
# Runs `wsync bench --smoke` and checks the contract of docs/benchmark.md: JSON rows, the last one the
# result with status pass and every required field; nothing of ours left in /dev/shm.
set -euo pipefail
wsync="$1"
mode="$2"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$wsync" bench --smoke --mode "$mode" --repeat 3 >"$out" &
bench=$!
wait "$bench"
last=$(tail -n 1 "$out")
fail() { echo "bench_smoke($mode): $*"; echo "last row: $last"; exit 1; }
# Every line is one JSON object.
while IFS= read -r line; do
  case "$line" in "{"*"}") ;; *) fail "not a JSON row: $line" ;; esac
done <"$out"
for field in '"mode":"'"$mode"'"' '"status":"pass"' '"blocker":null' '"layout":' '"tensors":' \
             '"bytes":' '"weight_version":' '"active_weight_version":' '"repeat":3' \
             '"timings_s":{' '"publish":' '"import":' '"verify":' '"install":' '"ack":' \
             '"release":' '"total":' '"baseline":{' '"name":"memcpy"' '"ratio_to_baseline":' \
             '"env":{' '"host":' '"cores":' '"transport_notes":'; do
  case "$last" in *"$field"*) ;; *) fail "missing $field" ;; esac
done
case "$last" in *"(pid -1)"*) fail "transport_notes name no consumer process" ;; esac
# The consumer must end on the last version published.
wv=$(sed -E 's/.*"weight_version":([0-9]+).*/\1/' <<<"$last")
av=$(sed -E 's/.*"active_weight_version":([0-9]+).*/\1/' <<<"$last")
[ "$wv" = "$av" ] || fail "active_weight_version $av != weight_version $wv"
# Nothing of the run's left in /dev/shm: the bench checks its consumer process's segments itself
# (the row fails if any is left); here, its own. Segments of other pids are not this run's:
# tests running beside it kill processes on purpose, and their segments wait for the sweep.
left=$(ls /dev/shm 2>/dev/null | grep "^wsync-$bench-" || true)
[ -z "$left" ] || fail "left in /dev/shm: $left"
echo "bench_smoke($mode): pass"
