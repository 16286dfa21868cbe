#!/usr/bin/env bash
# Runs `wsync bench --mode ucx --smoke`: one row over UCX_TLS=tcp, one over shared memory, each
# with ucx_perftest measured in the same run as its baseline (docs/benchmark.md). Checks the contract,
# not the speed: speed is for the benchmark's own figures.
set -euo pipefail
wsync="$1"
out=$(mktemp)
trap 'rm -f "$out" "$out.err"' EXIT
fail() { echo "bench_ucx: $*"; cat "$out"; exit 1; }
"$wsync" bench --smoke --mode ucx --repeat 3 >"$out" 2>"$out.err" || { cat "$out.err"; fail "exit status $?"; }
# The run's result comes last: both rows passed.
tail -n 1 "$out" | grep -q '"event":"result".*"status":"pass".*"statuses":\["pass","pass"\]' ||
  fail "the last line is not the run's result"
results=$(grep '"mode":"ucx"' "$out" | grep -v '"event":"' || true)
rows=$(grep -c . <<<"$results" | tr -d ' ')
[ "$rows" = 2 ] || fail "expected 2 result rows, got $rows"
for tls in tcp sm; do
  row=$(grep "\"ucx_tls\":\"$tls\"" <<<"$results") || fail "no row for $tls"
  for field in '"status":"pass"' '"blocker":null' '"name":"ucx_perftest"' '"gbps":' \
               '"message_bytes":' '"ratio_to_baseline":' '"import_gbps":' '"memcpy_baseline":' \
               '"timings_s":{' '"op":"'; do
    case "$row" in *"$field"*) ;; *) fail "$tls row: missing $field" ;; esac
  done
done
grep '"ucx_tls":"tcp"' <<<"$results" | grep -q '"op":"tag"' || fail "tcp must pull by tag"
grep '"ucx_tls":"sm"' <<<"$results" | grep -q '"op":"get"' || fail "shared memory must pull by get"
[ -z "$(ipcs -m 2>/dev/null | awk '$3 ~ /root/ && $6 == 0' | head -1)" ] ||
  echo "bench_ucx: note: unattached SysV segments exist (not necessarily ours)"
echo "bench_ucx: pass"
