#!/usr/bin/env bash
# Catch-up after the trainer exits (shared memory): a rank that joins once the publisher is gone
# gets the last committed version from a peer on the node that still maps it, and the status
# table names that peer; when nobody holds it any more, a joining rank says it waits for the
# next version (state "waiting", not "rejected") and installs that one when it comes. A
# coordinator that restarts in between takes the version from the ranks that serve it.
wsync="$1"
name=cluster_catch_up
source "$(dirname "$0")/processes.sh"
export WSYNC_TOKEN=catch-up-token
layout=synthetic:4194304:8
"$wsync" coordinator --port 0 --port-file "$work/port" --history 2 >"$work/coordinator.log" 2>&1 &
coordinator=$!
pids+=("$!")
wait_for_file "$work/port" || fail "the coordinator did not start"
addr="127.0.0.1:$(cat "$work/port")"
status() { "$wsync" status --coordinator "$addr" --json; }
# rank_field RANK FIELD: a consumer rank's field in the status table.
rank_field() {
  status | /usr/bin/env python3 -c "
import json, sys
for r in json.load(sys.stdin)['ranks']:
    if r['role'] == 'consumer' and r['rank'] == $1: print(r.get('$2'))"
}
wait_rank() {  # RANK FIELD VALUE: up to 20 s
  for _ in $(seq 400); do [ "$(rank_field "$1" "$2")" = "$3" ] && return 0; sleep 0.05; done
  return 1
}
start_consumer() {
  "$wsync" consumer --coordinator "$addr" --rank "$1" --model "$layout" >"$work/consumer$1.log" 2>&1 &
  consumer[$1]=$!
  pids+=("$!")
}
start_consumer 0
start_consumer 1
wait_for_consumers "$wsync" "$addr" 2 || fail "the consumers did not join"
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 3 --json \
  >"$work/publisher.log" 2>&1 || fail "the publisher failed"
[ "$(grep -c '"phase":"committed"' "$work/publisher.log")" -eq 3 ] || fail "not 3 commits"
ls /dev/shm | grep -q '^wsync-' && fail "the exited publisher left its slots behind"

# The trainer is gone; rank 2 joins and must still get version 3, from rank 0 or 1.
start_consumer 2
wait_rank 2 active_weight_version 3 || fail "rank 2 never caught up: $(rank_field 2 state) $(rank_field 2 reason)"
from=$(rank_field 2 received_from)
[[ "$from" =~ ^rank:[01]\ \(shared\ memory\)$ ]] || fail "rank 2 received_from: '$from'"
[ "$(rank_field 2 state)" = acknowledged ] || fail "rank 2 state: $(rank_field 2 state)"

# The coordinator dies and comes back knowing no manifests: the ranks re-join serving version 3
# and give its manifests, so rank 4, joining now, still gets version 3 from a peer.
port=$(cat "$work/port")
kill -KILL "$coordinator"
wait "$coordinator" 2>/dev/null
rm -f "$work/port"
"$wsync" coordinator --port "$port" --port-file "$work/port" --history 2 \
  >"$work/coordinator2.log" 2>&1 &
pids+=("$!")
wait_for_file "$work/port" || fail "the coordinator did not restart"
wait_for_consumers "$wsync" "$addr" 3 || fail "the consumers did not re-join the restarted coordinator"
start_consumer 4
wait_rank 4 active_weight_version 3 ||
  fail "rank 4 got nothing from the restarted coordinator: $(rank_field 4 state) $(rank_field 4 reason)"
from=$(rank_field 4 received_from)
[[ "$from" =~ ^rank:[012]\ \(shared\ memory\)$ ]] || fail "rank 4 received_from: '$from'"
grep -q "took .*@3 from consumer rank" "$work/coordinator2.log" ||
  fail "the restarted coordinator did not say where version 3 came from"

# Nobody holds version 3 any more: a new rank waits, and says why.
for r in 0 1 2 4; do kill -TERM "${consumer[$r]}"; wait "${consumer[$r]}"; done
start_consumer 3
wait_rank 3 state waiting || fail "rank 3 state: $(rank_field 3 state) ($(rank_field 3 reason))"
rank_field 3 reason | grep -q "waiting for the next version" || fail "rank 3 reason: $(rank_field 3 reason)"
[ "$(rank_field 3 active_weight_version)" = 0 ] || fail "rank 3 serves a version it never got"

# The trainer comes back: the waiting rank installs the next version.
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --first-version 4 \
  --versions 1 --json >"$work/publisher2.log" 2>&1 || fail "the second publisher failed"
grep -q '"phase":"committed"' "$work/publisher2.log" || fail "version 4 did not commit"
wait_rank 3 active_weight_version 4 || fail "rank 3 did not install version 4"
# --history 2: the status keeps about the last two finished updates, not all four.
kept=$(status | /usr/bin/env python3 -c "import json, sys; print(len(json.load(sys.stdin)['updates']))")
[ "$kept" -le 3 ] || fail "--history 2 kept $kept updates"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
check_no_segments
echo "cluster_catch_up: pass"
