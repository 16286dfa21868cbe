#!/usr/bin/env bash
# `wsync bench --mode cluster`: one JSON row per consumer count, every update committed by every
# rank, the 1-consumer baseline measured in the same run.
set -uo pipefail
wsync="$1"
out=$("$wsync" bench --mode cluster --consumers 1,4 --repeat 3 2>/dev/null) || { echo "$out"; exit 1; }
# Two rows, then the run's result on the last line.
result=$(tail -n 1 <<<"$out")
case "$result" in *'"event":"result"'*'"rows":2'*'"status":"pass"'*) ;;
  *) echo "cluster_bench: the last line is not the run's result: $result"; exit 1 ;; esac
out=$(grep -v '"event":"result"' <<<"$out")
[ "$(grep -c '"mode":"cluster"' <<<"$out")" -eq 2 ] || { echo "cluster_bench: want 2 rows: $out"; exit 1; }
grep -q '"status":"fail"' <<<"$out" && { echo "cluster_bench: $out"; exit 1; }
last=$(tail -n 1 <<<"$out")
for field in '"consumers":4' '"overhead":' '"commit":' '"name":"single-consumer-overhead"' \
             '"ratio_to_baseline":' '"weight_version":4'; do
  case "$last" in *"$field"*) ;; *) echo "cluster_bench: missing $field in $last"; exit 1 ;; esac
done
# Descriptors of the consumer process do not grow with its ranks: one per slot it maps.
fds() { sed -E 's/.*"consumer_process_fds":([0-9]+).*/\1/' <<<"$1"; }
first=$(head -n 1 <<<"$out")
case "$first$last" in *'"consumer_process_fds":null'*) echo "cluster_bench: no fd count"; exit 1 ;; esac
[ "$(fds "$last")" -le $(( $(fds "$first") + 2 )) ] ||
  { echo "cluster_bench: 4 ranks hold $(fds "$last") descriptors, 1 rank $(fds "$first")"; exit 1; }
# Four processes of one rank: without node leaders each gets its own update message; with them
# the node's leader gets one for all four.
out=$("$wsync" bench --mode cluster --consumers 4 --processes 4 --repeat 3 2>/dev/null) ||
  { echo "$out"; exit 1; }
grep -q '"status":"fail"' <<<"$out" && { echo "cluster_bench: $out"; exit 1; }
sent() { sed -E 's/.*"updates_sent":([0-9.]+).*/\1/' <<<"$1"; }
direct=$(grep '"node_leader":false,"processes":4' <<<"$out")
led=$(grep '"node_leader":true,"processes":4' <<<"$out")
[ -n "$direct" ] && [ -n "$led" ] || { echo "cluster_bench: want rows with and without leaders: $out"; exit 1; }
[ "$(sent "$direct")" = 4.0 ] || { echo "cluster_bench: without leaders: $(sent "$direct") update messages per update"; exit 1; }
[ "$(sent "$led")" = 1.0 ] || { echo "cluster_bench: with a leader: $(sent "$led") update messages per update"; exit 1; }
case "$led" in *'"name":"no-node-leader-overhead"'*) ;; *) echo "cluster_bench: no baseline in $led"; exit 1 ;; esac
echo "cluster_bench: pass"
