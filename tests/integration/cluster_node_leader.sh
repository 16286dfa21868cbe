#!/usr/bin/env bash
# Node leaders across processes: four consumer processes of one rank each on node n0, one on n1.
# The coordinator names one process n0's leader; the others attach to it, so each
# update reaches a node in one message and the node's answers come back in few batches. When the
# leader is SIGKILLed while versions stream in, the next process leads, what the dead leader
# carried is sent again, and every version still commits on every surviving rank.
wsync="$1"
name=cluster_node_leader
source "$(dirname "$0")/processes.sh"
export WSYNC_TOKEN=node-leader-token
layout=synthetic:1048576:8
"$wsync" coordinator --port 0 --port-file "$work/port" >"$work/coordinator.log" 2>&1 &
pids+=("$!")
wait_for_file "$work/port" || fail "the coordinator did not start"
addr="127.0.0.1:$(cat "$work/port")"
status() { "$wsync" status --coordinator "$addr" --json; }
# field PY_EXPR: evaluates PY_EXPR over the status object `s`.
field() { status | /usr/bin/env python3 -c "import json, sys; s = json.load(sys.stdin); print($1)"; }
carried() {  # RANK: whom the rank's reports go through ("None": straight to the coordinator)
  field "next((r.get('via') for r in s['ranks'] if r['role'] == 'consumer' and r['rank'] == $1), 'gone')"
}
# n0's leader once exactly one of its ranks is not carried and every other names it; else "".
leader_of_n0() {
  field "(lambda c: (lambda l: l[0] if len(l) == 1 and all(v == 'rank:%d' % l[0] for r, v in c.items() if r != l[0]) else '')([r for r, v in c.items() if v is None]))({r['rank']: r.get('via') for r in s['ranks'] if r['role'] == 'consumer' and r['node'] == 'n0'})"
}
wait_leader() {  # up to 20 s; prints the leader's rank
  local l
  for _ in $(seq 400); do
    l=$(leader_of_n0)
    [ -n "$l" ] && { echo "$l"; return 0; }
    sleep 0.05
  done
  return 1
}
start_consumer() {  # RANK NODE
  "$wsync" consumer --coordinator "$addr" --rank "$1" --node "$2" --model "$layout" \
    >"$work/consumer$1.log" 2>&1 &
  consumer[$1]=$!
  pids+=("$!")
}
for r in 0 1 2 3; do start_consumer "$r" n0; done
start_consumer 4 n1
wait_for_consumers "$wsync" "$addr" 5 || fail "the consumers did not join"
leader=$(wait_leader) || fail "n0's ranks are not all carried by one leader: $(status)"
[ "$(carried 4)" = None ] || fail "rank 4 (alone on n1) is carried: $(carried 4)"

"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 5 --json \
  >"$work/publisher.log" 2>&1 || fail "the publisher failed"
[ "$(grep -c '"phase":"committed"' "$work/publisher.log")" -eq 5 ] || fail "not 5 commits"
# One update message per node and version: n0's four processes share one.
sent=$(field "s['messages']['updates_sent']")
[ "$sent" -eq 10 ] || fail "$sent update messages for 5 versions to 2 nodes (want 10)"
read -r messages reports < <(field "s['messages']['report_messages'], s['messages']['reports']" | tr -d '(),')
echo "5 versions, 5 ranks on 2 nodes: $sent update messages, $reports reports in $messages messages"
# Without leaders each of the five processes sends at least one batch a version (25).
[ "$messages" -lt 25 ] || fail "$messages report messages: the node's reports were not gathered"

# The leader dies while versions stream in; rank 1's process takes over.
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --first-version 6 \
  --versions 20 --interval-ms 100 --json >"$work/publisher2.log" 2>&1 &
publisher=$!
pids+=("$publisher")
for _ in $(seq 200); do
  [ "$(grep -c '"phase":"committed"' "$work/publisher2.log")" -ge 3 ] && break
  sleep 0.05
done
kill -KILL "${consumer[$leader]}"
wait "$publisher" || fail "the second publisher failed"
next=$(wait_leader) || fail "no new leader for n0: $(status)"
[ "$next" != "$leader" ] || fail "the dead rank $leader still leads n0"
[ "$(grep -c '"phase":"committed"' "$work/publisher2.log")" -eq 20 ] ||
  fail "$(grep -c '"phase":"committed"' "$work/publisher2.log") of 20 versions committed"
for r in 0 1 2 3 4; do
  [ "$r" = "$leader" ] && continue
  v=$(field "next(r['active_weight_version'] for r in s['ranks'] if r['role'] == 'consumer' and r['rank'] == $r)")
  [ "$v" = 25 ] || fail "rank $r serves version $v, not 25"
done
grep -q "leads the consumer endpoints of its node" "$work/consumer$next.log" ||
  fail "rank $next's process never said it leads"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
check_no_segments
echo "cluster_node_leader: pass"
