#!/usr/bin/env bash
# The HTTP surface on coordinator-driven consumer ranks: /status and /metrics follow the
# updates the coordinator sends, the four phases answer 409, and a generation held by
# /pause?mode=keep across a cluster update sees the old version, then the new one, never a mix.
wsync="$1"
name=http_cluster
source "$(dirname "$0")/processes.sh"
export WSYNC_TOKEN=cluster-token
layout=synthetic:2097152:4

"$wsync" coordinator --port 0 --port-file "$work/cport" >"$work/coordinator.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do [ -s "$work/cport" ] && break; sleep 0.05; done
addr="127.0.0.1:$(cat "$work/cport")"
"$wsync" consumer --coordinator "$addr" --rank 0 --count 2 --model "$layout" \
  --enable-weight-transfer --http-port-file "$work/hport" >"$work/consumer.log" 2>&1 &
consumer=$!
pids+=("$consumer")
for _ in $(seq 200); do [ -s "$work/hport" ] && break; sleep 0.05; done
[ -s "$work/hport" ] || fail "consumer HTTP did not start"
base="http://127.0.0.1:$(cat "$work/hport")"
wait_for_consumers "$wsync" "$addr" 2 || fail "the consumers did not join"

"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 1 \
  >"$work/publisher1.log" 2>&1 || fail "version 1 did not commit"
status=$(curl -s "$base/status")
grep -q '"active_weight_version":1' <<<"$status" || fail "status does not show version 1: $status"
grep -q '"phase":"following' <<<"$status" || fail "status does not say it follows the coordinator"
code=$(curl -s -o "$work/start.json" -w '%{http_code}' -X POST "$base/start_weight_update")
[ "$code" = 409 ] || fail "start on a coordinator-driven rank: HTTP $code"
grep -q "follows the coordinator" "$work/start.json" || fail "409 does not say why: $(cat "$work/start.json")"

# A long generation, held by pause(keep) while version 2 installs, then resumed.
curl -s -X POST "$base/generate" -d '{"steps": 400, "step_ms": 2}' >"$work/generation.json" &
gen=$!
sleep 0.2
[ "$(curl -s -X POST "$base/pause?mode=keep")" = '{"status":"paused"}' ] || fail "pause keep"
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 1 \
  --first-version 2 >"$work/publisher2.log" 2>&1 || fail "version 2 did not commit while paused"
curl -s -X POST "$base/resume" >/dev/null
wait "$gen"
grep -q '"status":"completed"' "$work/generation.json" || fail "generation: $(cat "$work/generation.json")"
grep -q '"weight_versions":\[1,2\]' "$work/generation.json" ||
  fail "the held generation did not see 1 then 2: $(cat "$work/generation.json")"
# Both ranks hold the same bytes: the weight checker of rank 1 matches rank 0's checksums, and
# the version label follows the coordinator's updates.
sums=$(curl -s -X POST "$base/weight_checker" -d '{"action":"checksum","rank":0}')
grep -q '"weight_version":2' <<<"$sums" || fail "checksum of rank 0: $sums"
baseline=$(sed 's/.*"checksums":\({[^}]*}\).*/\1/' <<<"$sums")
cmp=$(curl -s -X POST "$base/weight_checker" -d "{\"action\":\"compare\",\"rank\":1,\"baseline\":$baseline}")
grep -q '"compared":4,"match":true' <<<"$cmp" || fail "rank 1 against rank 0's checksums: $cmp"
[ "$(curl -s "$base/weight_info")" = '{"weight_version":"2"}' ] || fail "weight_info: $(curl -s "$base/weight_info")"
metrics=$(curl -s "$base/metrics")
grep -q '^wsync_ranks{state="acknowledged"} 2' <<<"$metrics" || fail "per-rank state counts: $metrics"
grep -q '^wsync_updates_committed_total 4' <<<"$metrics" || fail "committed count: $metrics"

kill -TERM "$consumer"
for _ in $(seq 200); do kill -0 "$consumer" 2>/dev/null || break; sleep 0.05; done
kill -0 "$consumer" 2>/dev/null && fail "the consumer did not stop on SIGTERM"
# Stopped by its own handler (ranks released, exit 0), not killed by the signal (143).
wait "$consumer"
rc=$?
[ $rc -eq 0 ] || fail "the consumer exited $rc on SIGTERM: $(tail -5 "$work/consumer.log")"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait 2>/dev/null
pids=()
check_no_segments
echo "http_cluster: pass"
