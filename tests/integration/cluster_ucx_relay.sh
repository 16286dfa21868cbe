#!/usr/bin/env bash
# The coordinator routes updates along the fan-out plan: 2 consumer processes of 2 ranks on
# nodes n1 and n2, a publisher on n0, all on the ucx transport over TCP on loopback. With the
# default striped tree each node's leader takes one stripe from the publisher and the other
# from the other node's leader, members take everything from their leader; every rank
# acknowledges every version, and `wsync status` shows each rank's source. Once the publisher
# exited, a rank that joins catches up from a rank on its node that holds the last version.
wsync="$1"
name=cluster_ucx_relay
source "$(dirname "$0")/processes.sh"
export WSYNC_TOKEN=relay-token
layout=synthetic:8388608:16
ucx=(--transport ucx --transport-option tls=tcp)
"$wsync" coordinator --port 0 --port-file "$work/port" --plan tree >"$work/coordinator.log" 2>&1 &
pids+=("$!")
wait_for_file "$work/port" || fail "the coordinator did not start"
addr="127.0.0.1:$(cat "$work/port")"
for first in 0 2; do
  "$wsync" consumer --coordinator "$addr" --rank $first --count 2 --node "n$((first / 2 + 1))" \
    --model "$layout" "${ucx[@]}" >"$work/consumer$first.log" 2>&1 &
  pids+=("$!")
done
wait_for_consumers "$wsync" "$addr" 4 || fail "the consumers did not join"
timeout 120 "$wsync" publisher --coordinator "$addr" --rank 0 --node n0 --layout "$layout" \
  --versions 3 --json "${ucx[@]}" >"$work/publisher.log" 2>&1 || fail "the publisher failed"
[ "$(grep -c '"phase":"committed"' "$work/publisher.log")" -eq 3 ] || fail "not 3 commits"
[ "$(grep -o '"acknowledged":true' "$work/publisher.log" | wc -l)" -eq 12 ] ||
  fail "not every consumer acknowledged every version"
status=$("$wsync" status --coordinator "$addr" --json)
expect() {  # rank, received_from
  grep -q "\"rank\":$1,\"received_from\":\"$2\"" <<<"$(tr -d ' ' <<<"$status" | sed 's/"model":"[^"]*",//g; s/"node":"n[0-9]",//g; s/"active_weight_version":[0-9]*,//g; s/"reason":null,//g')" ||
    fail "rank $1 should have received from \"$2\": $status"
}
expect 0 'stripes:publisher:0|rank:2(network)'
expect 1 'rank:0(sharedmemory)'
expect 2 'stripes:rank:0(network)|publisher:0'
expect 3 'rank:2(sharedmemory)'
# The publisher has exited: a rank joining n1 now catches up on version 3 from a rank there that
# still holds it (a relay of the ucx transport), not from the publisher.
"$wsync" consumer --coordinator "$addr" --rank 4 --node n1 --model "$layout" "${ucx[@]}" \
  >"$work/consumer4.log" 2>&1 &
pids+=("$!")
for _ in $(seq 400); do
  status=$("$wsync" status --coordinator "$addr" --json | sed 's/"model":"[^"]*",//g')
  grep -q '"active_weight_version":3,"node":"n1","rank":4' <<<"$status" && break
  sleep 0.05
done
grep -q '"active_weight_version":3,"node":"n1","rank":4' <<<"$status" ||
  fail "rank 4 did not catch up after the publisher exited: $status"
expect 4 'rank:0(sharedmemory)'
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
echo "cluster_ucx_relay: pass"
