#!/usr/bin/env bash
# A coordinated cluster over file-mmap: 1 coordinator, 1 publisher rank, 2 consumer ranks, 6
# versions through a directory on disk. Every consumer acknowledges every version in order, the
# coordinator's releases free the buffers (two buffers carry all six versions), no lease is left.
wsync="$1"
name=cluster_file_mmap
source "$(dirname "$0")/processes.sh"
export WSYNC_TOKEN=fmm-token
layout=synthetic:8388608:16
dir="$work/weights"
opts=(--transport file-mmap --transport-option "dir=$dir")
"$wsync" coordinator --port 0 --port-file "$work/port" >"$work/coordinator.log" 2>&1 &
pids+=("$!")
wait_for_file "$work/port" || fail "the coordinator did not start"
addr="127.0.0.1:$(cat "$work/port")"
for r in 0 1; do
  "$wsync" consumer --coordinator "$addr" --rank $r --model "$layout" "${opts[@]}" \
    >"$work/consumer$r.log" 2>&1 &
  pids+=("$!")
done
wait_for_consumers "$wsync" "$addr" 2 || fail "the consumers did not join"
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 6 --json \
  "${opts[@]}" >"$work/publisher.log" 2>&1 || fail "the publisher failed"
[ "$(grep -c '"phase":"committed"' "$work/publisher.log")" -eq 6 ] || fail "fewer than 6 commits"
[ "$(grep -o '"acknowledged":true' "$work/publisher.log" | wc -l)" -eq 12 ] ||
  fail "not every consumer acknowledged every version"
for r in 0 1; do
  seen=$(grep -o 'active version [0-9]*' "$work/consumer$r.log" | awk '{print $3}' | tr '\n' ' ')
  [ "$seen" = "1 2 3 4 5 6 " ] || fail "consumer $r activated: $seen"
done
[ "$(ls -d "$dir"/buffer-* | wc -l)" -eq 2 ] || fail "expected two buffers: $(ls "$dir")"
grep -q '"weight_version":6' "$dir/CURRENT" || fail "CURRENT does not name version 6"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
[ -z "$(ls "$dir/leases")" ] || fail "leases left behind: $(ls "$dir/leases")"
echo "cluster_file_mmap: pass"
