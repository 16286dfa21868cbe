#!/usr/bin/env bash
# The emulated cluster: 3 consumer nodes of 2 ranks and a publisher node, as network namespaces
# with 200 Mbit/s links, every byte over UCX's TCP on the nodes' own interfaces. Every plan must
# commit on every rank; then a top leader is SIGKILLed mid-update and its subtree must still
# commit through its fallback sources while only the victim fails. Needs root (namespaces, tc);
# exits 77 (skipped) without it. Nothing may be left: namespaces, processes, segments.
set -uo pipefail
wsync="$1"
if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "fanout: skipped: needs root and iproute2 (ip, tc) for network namespaces"
  exit 77
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() { echo "fanout: $*"; cut -c1-2000 "$out"; exit 1; }
timeout 240 "$wsync" bench --mode fanout --smoke --nodes 3 --ranks-per-node 2 --plan chain,tree,star,naive \
  --rate-mbit 200 --kill-leader >"$out" 2>&1
rc=$?
# A machine that cannot make network namespaces (a container's or a chroot's root) is not a
# failure of ours: the benchmark says blocked and why, and the test skips with that reason.
if blocked=$(grep -m1 '"status":"blocked"' "$out"); then
  echo "fanout: skipped: $(sed -E 's/.*"blocker":"([^"]*)".*/\1/' <<<"$blocked")"
  exit 77
fi
[ $rc -eq 0 ] || fail "exit status $rc"
for plan in chain tree star; do
  row=$(grep '"mode":"fanout"' "$out" | grep -v kill_leader | grep "\"plan\":\"$plan\"") ||
    fail "no row for $plan"
  # A tree is striped: its leaders list one source per stripe, one of them the publisher.
  first='"received_from":"publisher:0"'
  [ "$plan" = tree ] && first='"received_from":"stripes: publisher:0 |'
  for field in '"status":"pass"' '"name":"single-consumer"' '"ratio_to_baseline":' '"commit":' \
               '"per_hop":' "$first" '"nodes":3' '"ranks_per_node":2'; do
    case "$row" in *"$field"*) ;; *) fail "$plan row: missing $field" ;; esac
  done
  [ "$(grep -o '"state":"acknowledged"' <<<"$row" | wc -l)" -eq 6 ] || fail "$plan: not 6 ranks acknowledged"
  case "$row" in *'"ratio_to_naive":'*) ;; *) fail "$plan row: no ratio to the naive plan" ;; esac
done
# The naive plan: every rank straight from the publisher, measured first, the others' baseline.
naive=$(grep '"mode":"fanout"' "$out" | grep '"plan":"naive"') || fail "no row for naive"
case "$naive" in *'"status":"pass"'*) ;; *) fail "naive plan did not pass" ;; esac
[ "$(grep -o '"received_from":"publisher:0"' <<<"$naive" | wc -l)" -eq 6 ] ||
  fail "naive: not every rank took the update from the publisher"
kill=$(grep '"event":"kill_leader"' "$out") || fail "no kill_leader row"
case "$kill" in *'"status":"pass"'*) ;; *) fail "kill_leader did not pass" ;; esac
victim=$(sed -E 's/.*"victim":([0-9]+).*/\1/' <<<"$kill")
case "$kill" in *"\"failed\":[$victim]"*) ;; *) fail "only the victim may fail" ;; esac
case "$kill" in *'"acknowledged":5'*) ;; *) fail "the 5 live ranks must acknowledge" ;; esac
ip netns list | grep -q 'wsync-fan-' && fail "namespaces left: $(ip netns list | grep wsync-fan-)"
pgrep -f 'wsync bench --mode fanout' >/dev/null && fail "processes left"
echo "fanout: pass"
