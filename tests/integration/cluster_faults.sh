#!/usr/bin/env bash
# Fault tests on a loopback cluster of real processes: a peer with a wrong token, a consumer
# killed with SIGKILL, a publisher killed with SIGKILL, a frozen (SIGSTOP) consumer. Each asserts
# the outcome the design promises and that no process or /dev/shm segment is left behind.
set -uo pipefail
wsync="$1"
rogue="$2"  # wsync_rogue_peer
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "cluster_faults: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -n 15 "$f"; done; exit 1; }
export WSYNC_TOKEN=right-token
layout=synthetic:4194304:8

start_coordinator() {
  rm -f "$work/port"
  "$wsync" coordinator --port 0 --port-file "$work/port" --update-deadline-ms "${1:-20000}" \
    >"$work/coordinator.log" 2>&1 &
  coord=$!
  pids+=("$coord")
  for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
  [ -s "$work/port" ] || fail "coordinator did not start"
  addr="127.0.0.1:$(cat "$work/port")"
}
start_consumer() {  # rank
  "$wsync" consumer --coordinator "$addr" --rank "$1" --model "$layout" \
    >"$work/consumer$1.log" 2>&1 &
  pids+=("$!")
  eval "consumer$1=$!"
}
status() { "$wsync" status --coordinator "$addr" --json; }
wait_consumers() {  # count
  for _ in $(seq 200); do
    [ "$(status | grep -o '"role":"consumer"' | wc -l)" -ge "$1" ] && return 0
    sleep 0.05
  done
  fail "fewer than $1 consumers joined"
}
stop_all() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 200); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
    if kill -0 "$p" 2>/dev/null; then
      # Where it is stuck, for the log fail() prints (gdb only where the machine has it).
      command -v gdb >/dev/null && gdb -p "$p" -batch -ex "thread apply all bt" >"$work/stuck-$p.log" 2>&1
      fail "pid $p did not stop on SIGTERM"
    fi
  done
  wait 2>/dev/null
  for p in "${pids[@]}"; do
    ls /dev/shm | grep -q "^wsync-$p-" && fail "segment of pid $p left in /dev/shm"
  done
  pids=()
}

# 1. A peer with a wrong token is refused and changes nothing.
start_coordinator
WSYNC_TOKEN=wrong "$wsync" consumer --coordinator "$addr" --rank 9 --model "$layout" \
  >"$work/intruder.log" 2>&1 &
intruder=$!
pids+=("$intruder")
for _ in $(seq 200); do kill -0 "$intruder" 2>/dev/null || break; sleep 0.05; done
kill -0 "$intruder" 2>/dev/null && fail "a consumer with a wrong token kept running"
grep -q "token" "$work/intruder.log" || fail "the refused consumer does not say why"
grep -q "refused rank 9: wrong cluster token" "$work/coordinator.log" || fail "refusal not logged"
status | grep -q '"rank":9' && fail "the intruder shows up in status"
# A publisher with a wrong token fails at once, naming the refusal (not later, per publish).
WSYNC_TOKEN=wrong timeout 30 "$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" \
  --versions 1 >"$work/intruder-pub.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "a publisher with a wrong token: exit $rc: $(tail -3 "$work/intruder-pub.log")"
grep -q "publisher rank 0: join refused: token: wrong cluster token" "$work/intruder-pub.log" ||
  fail "the refused publisher does not say why: $(tail -3 "$work/intruder-pub.log")"
grep -q "publisher rank 0 version" "$work/intruder-pub.log" &&
  fail "a refused publisher went on to publish: $(tail -3 "$work/intruder-pub.log")"
WSYNC_TOKEN=wrong "$wsync" status --coordinator "$addr" --json | grep -q error || fail "status without token"
# A peer without the token sends kill / shutdown exits, an error, a forged down message, a
# publish, a report: all refused, the coordinator still answers, and the cluster still commits.
"$rogue" 127.0.0.1 "${addr##*:}" >"$work/rogue.log" 2>&1 || fail "a peer without the token got through: $(cat "$work/rogue.log")"
grep -q "refused an exit message from outside" "$work/coordinator.log" || fail "exit refusal not logged"
kill -0 "$coord" 2>/dev/null || fail "the coordinator process ended after the rogue peer"
for r in 0 1; do start_consumer $r; done
wait_consumers 2
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 1 >"$work/publisher.log" 2>&1 ||
  fail "no commit after the rogue peer"
stop_all
echo "cluster_faults: wrong token and a rogue peer refused"

# 2. A consumer killed with SIGKILL mid-update: failed for its in-flight update, the others
#    commit. Freezing it first makes "mid-update" deterministic: the update reaches it, then it dies.
start_coordinator
for r in 0 1 2; do start_consumer $r; done
wait_consumers 3
kill -STOP "$consumer1"
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 3 --json \
  >"$work/publisher.log" 2>&1 &
publisher=$!
pids+=("$publisher")
sleep 0.3
kill -KILL "$consumer1"
wait "$publisher" || fail "publisher failed after a consumer died"
# Normally the update reaches it frozen and the kill fails it; on a slow machine (sanitizers) the
# heartbeat may declare it down first, and then it is simply not part of version 1. Either way
# it never counts as acknowledged.
v1=$(grep '"weight_version":1}' "$work/publisher.log")
grep -q '"rank":1,"reason":"down[^"]*","received_from":"[^"]*","state":"failed"' <<<"$v1" ||
  ! grep -q '"rank":1,' <<<"$v1" || fail "version 1 shows the dead consumer as neither failed nor absent"
grep -q '"acknowledged":true,"data_s":[0-9.e+-]*,"rank":1,' "$work/publisher.log" &&
  fail "the dead consumer was counted as acknowledged"
tail -n 1 "$work/publisher.log" | grep -q '"phase":"committed"' || fail "last version not committed"
s=$(status)
for r in 0 2; do
  grep -qE "\"active_weight_version\":3,\"model\":\"[^\"]*\",\"node\":\"[^\"]*\",\"rank\":$r," <<<"$s" ||
    fail "consumer $r is not on version 3: $s"
done
stop_all
echo "cluster_faults: killed consumer failed, others committed"

# 3. A publisher killed with SIGKILL mid-update: version 2 is assembling (publisher 0's shard is
#    in, publisher 1 sleeps before sending its own) when publisher 1 dies; version 2 is aborted,
#    consumers keep version 1, and publisher 0 hears the abort.
start_coordinator
for r in 0 1; do start_consumer $r; done
wait_consumers 2
"$wsync" publisher --coordinator "$addr" --rank 0 --ranks 2 --layout "$layout" --versions 2 \
  --json >"$work/p0.log" 2>&1 &
p0=$!
"$wsync" publisher --coordinator "$addr" --rank 1 --ranks 2 --layout "$layout" --versions 2 \
  --interval-ms 3000 --json >"$work/p1.log" 2>&1 &
p1=$!
pids+=("$p0" "$p1")
for _ in $(seq 200); do grep -q '"weight_version":1' "$work/p1.log" && break; sleep 0.05; done
grep -q '"weight_version":1' "$work/p1.log" || fail "version 1 did not commit"
kill -KILL "$p1"
wait "$p0" && fail "publisher 0 reported success for a version whose other shard never came"
grep -q '"phase":"aborted","publish_s":[0-9.e+-]*,"ranks":\[[^]]*\],"reason":"publisher rank 1 went away' "$work/p0.log" ||
  fail "version 2 was not aborted for the dead publisher: $(cat "$work/p0.log")"
s=$(status)
[ "$(grep -o '"active_weight_version":1,' <<<"$s" | wc -l)" -eq 2 ] ||
  fail "consumers did not keep version 1: $s"
# The dead publisher could not unlink its slots; the next publisher on the node sweeps them,
# and the cluster goes on with version 3.
ls /dev/shm | grep -q "^wsync-$p1-" || fail "expected the killed publisher's slots to be orphaned"
for r in 0 1; do
  "$wsync" publisher --coordinator "$addr" --rank $r --ranks 2 --layout "$layout" \
    --first-version 3 --versions 1 >"$work/again$r.log" 2>&1 &
  again[$r]=$!
  pids+=("$!")
done
for r in 0 1; do wait "${again[$r]}" || fail "publisher $r failed after the crash"; done
ls /dev/shm | grep -q "^wsync-$p1-" && fail "the killed publisher's slots were not swept"
s=$(status)
[ "$(grep -o '"active_weight_version":3,' <<<"$s" | wc -l)" -eq 2 ] || fail "not on version 3: $s"
stop_all
echo "cluster_faults: killed publisher aborted its update, its slots were swept, the cluster went on"

# 4. A frozen consumer (SIGSTOP) is detected by heartbeats and failed; the others commit.
start_coordinator 20000
for r in 0 1; do start_consumer $r; done
wait_consumers 2
kill -STOP "$consumer1"
start=$(date +%s%N)
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 1 --json \
  >"$work/publisher.log" 2>&1 || fail "publisher failed with a frozen consumer"
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
grep -q '"state":"failed"' "$work/publisher.log" || fail "frozen consumer not failed"
[ "$elapsed_ms" -lt 15000 ] || fail "frozen consumer took ${elapsed_ms} ms to detect"
stop_all
echo "cluster_faults: frozen consumer failed after ${elapsed_ms} ms"
# 4b. A consumer frozen past the heartbeat timeout while it serves views of version 1's slot
#     (`wsync consumer` installs views): the coordinator takes it for dead and version 1 is
#     released, but the publisher must not rewrite that slot under it. It leaves the slot to the
#     frozen reader and takes a new one; the reader, woken, rejoins and catches up.
start_coordinator 20000
for r in 0 1; do start_consumer $r; done
wait_consumers 2
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 3 --interval-ms 2500 \
  --json >"$work/publisher.log" 2>&1 &
publisher=$!
pids+=("$publisher")
for _ in $(seq 300); do grep -q '"phase":"committed".*"weight_version":1}' "$work/publisher.log" && break; sleep 0.05; done
grep -q '"phase":"committed".*"weight_version":1}' "$work/publisher.log" || fail "version 1 did not commit"
kill -STOP "$consumer1"
wait "$publisher" || fail "publisher failed with a consumer frozen past the heartbeat timeout"
grep -q "slot wsync-$publisher-[0-9a-f]* is still read by pid $consumer1 " "$work/publisher.log" ||
  fail "the slot the frozen consumer serves was not left to it: $(grep -i 'still read' "$work/publisher.log")"
tail -n 1 "$work/publisher.log" | grep -q '"phase":"committed"' || fail "version 3 not committed"
kill -CONT "$consumer1"
caught_up=0
for _ in $(seq 200); do
  status | grep -qE '"active_weight_version":3,"model":"[^"]*","node":"[^"]*","rank":1,' && { caught_up=1; break; }
  sleep 0.05
done
[ $caught_up = 1 ] || fail "the woken consumer did not catch up to version 3: $(status)"
stop_all
echo "cluster_faults: a frozen consumer's slot was left to it, and it caught up once woken"
# 5. The coordinator dies and restarts on the same port: consumers keep serving, every rank
#    reconnects with backoff and re-registers, and versions stay monotonic because consumers
#    report what they serve. The publisher sleeps between versions; the restart falls in a sleep.
start_coordinator
port=$(cat "$work/port")
for r in 0 1; do start_consumer $r; done
wait_consumers 2
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 4 \
  --interval-ms 2500 --json >"$work/publisher.log" 2>&1 &
publisher=$!
pids+=("$publisher")
for _ in $(seq 200); do grep -q '"weight_version":2' "$work/publisher.log" && break; sleep 0.05; done
grep -q '"weight_version":2' "$work/publisher.log" || fail "version 2 did not commit"
kill -KILL "$coord"
"$wsync" coordinator --port "$port" --port-file "$work/port2" >"$work/coordinator2.log" 2>&1 &
pids+=("$!")
wait_consumers 2
s=$(status)
# Version 2, or 3 when a slow machine (ASan) rejoined so late that the publisher's next version
# came first: never 0, which a consumer that lost what it served would say.
[ "$(grep -oE '"active_weight_version":[23],' <<<"$s" | wc -l)" -eq 2 ] ||
  fail "consumers did not keep serving version 2 across the restart: $s"
wait "$publisher" || fail "the publisher did not carry on after the restart: $(tail -n 3 "$work/publisher.log")"
grep -q "reconnected to the coordinator" "$work/publisher.log" || fail "publisher did not reconnect"
s=$(status)
[ "$(grep -o '"active_weight_version":4,' <<<"$s" | wc -l)" -eq 2 ] || fail "not on version 4: $s"
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 1 --json \
  >"$work/stale.log" 2>&1 && fail "version 1 accepted after the restart"
# Refused by the coordinator itself (not merely rejected by every consumer).
grep -q "version 1: weight_version must increase monotonically" "$work/stale.log" ||
  fail "stale version not refused as non-monotonic: $(cat "$work/stale.log")"
stop_all
echo "cluster_faults: coordinator restart: every rank rejoined, the publisher carried on, versions stayed monotonic"
echo "cluster_faults: pass"
