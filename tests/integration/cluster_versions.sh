#!/usr/bin/env bash
# 1 coordinator, 2 publisher ranks, 4 consumer ranks, 20 versions on loopback: every consumer
# acknowledges every version, and the versions each consumer activates strictly increase.
wsync="$1"
name=cluster_versions
source "$(dirname "$0")/processes.sh"
export WSYNC_TOKEN=versions-token
layout=synthetic:8388608:16
"$wsync" coordinator --port 0 --port-file "$work/port" >"$work/coordinator.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
addr="127.0.0.1:$(cat "$work/port")"
for r in 0 1 2 3; do
  "$wsync" consumer --coordinator "$addr" --rank $r --node "n$((r % 2))" --model "$layout" \
    >"$work/consumer$r.log" 2>&1 &
  pids+=("$!")
done
wait_for_consumers "$wsync" "$addr" 4 || fail "the consumers did not join"
for r in 0 1; do
  "$wsync" publisher --coordinator "$addr" --rank $r --ranks 2 --layout "$layout" --versions 20 \
    --json >"$work/publisher$r.log" 2>&1 &
  pub[$r]=$!
  pids+=("$!")
done
for r in 0 1; do wait "${pub[$r]}" || fail "publisher $r failed: $(tail -n 3 "$work/publisher$r.log")"; done
for r in 0 1; do
  [ "$(grep -c '"phase":"committed"' "$work/publisher$r.log")" -eq 20 ] ||
    fail "publisher $r saw fewer than 20 commits"
  [ "$(grep -o '"acknowledged":true' "$work/publisher$r.log" | wc -l)" -eq 80 ] ||
    fail "publisher $r: not every consumer acknowledged every version"
done
for r in 0 1 2 3; do
  seq_seen=$(grep -o 'active version [0-9]*' "$work/consumer$r.log" | awk '{print $3}' | tr '\n' ' ')
  [ "$seq_seen" = "$(seq -s ' ' 1 20) " ] || fail "consumer $r activated: $seq_seen"
done
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
for p in "${pids[@]}"; do ls /dev/shm | grep -q "^wsync-$p-" && fail "segment of pid $p left"; done
echo "cluster_versions: pass"
