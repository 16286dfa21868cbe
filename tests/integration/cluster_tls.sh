#!/usr/bin/env bash
# TLS between cluster processes (CAF's OpenSSL module), with certificates from `wsync certs`: a
# coordinator, a consumer and a publisher commit versions; neither a peer without TLS nor one
# with a certificate from another CA can reach the coordinator. Off loopback, a coordinator
# without TLS is refused unless --insecure (then it warns).
wsync=$(readlink -f "$1")
name=cluster_tls
source "$(dirname "$0")/processes.sh"
command -v openssl >/dev/null || fail "openssl is not installed (scripts/bootstrap.sh installs it)"
cd "$work"
"$wsync" certs --out "$work/pki" --nodes localhost,10.1.2.3 >"$work/certs.log" 2>&1 ||
  fail "wsync certs failed: $(cat "$work/certs.log")"
[ "$(stat -c %a "$work/pki/localhost.key")" = 600 ] || fail "a key is not mode 0600"
[ "$(stat -c %a "$work/pki/ca.key")" = 600 ] || fail "the CA key is not mode 0600"
openssl verify -CAfile "$work/pki/ca.pem" "$work/pki/localhost.pem" "$work/pki/10.1.2.3.pem" \
  >/dev/null || fail "node certificates do not verify against the CA"
"$wsync" certs --out "$work/pki" --nodes localhost >/dev/null 2>&1 &&
  fail "wsync certs overwrote an existing set"
# A disk that fills part way: nothing of the set stays (a rerun would refuse a mixed one). On a
# 16 KiB tmpfs in a private mount namespace (root); skipped where there is none.
mkdir "$work/small"
if unshare -m true 2>/dev/null; then
  # The tmpfs exists only in that namespace: what stayed in it is counted there.
  unshare -m bash -c 'mount -t tmpfs -o size=16k tmpfs "$1" || exit 9
    "$2" certs --out "$1/pki" --nodes "$3" && exit 8
    echo "left: $(ls -A "$1/pki" | wc -l)"' \
    _ "$work/small" "$wsync" "$(seq -s, -f 'n%g' 0 30)" >"$work/full.log" 2>&1
  rc=$?
  [ $rc -ne 8 ] || fail "wsync certs filled a 16 KiB disk without an error"
  if [ $rc -ne 9 ]; then
    grep -q "cannot write" "$work/full.log" || fail "a full disk was not explained: $(cat "$work/full.log")"
    grep -q "^left: 0$" "$work/full.log" || fail "a partial certificate set stayed: $(cat "$work/full.log")"
  fi
fi
# A second, unrelated CA: its certificates must not get in.
"$wsync" certs --out "$work/rogue" --nodes localhost >/dev/null 2>&1 || fail "second CA failed"

# Off loopback without TLS: refused, or warned with --insecure.
export WSYNC_TOKEN=tls-token
out=$(timeout 10 "$wsync" coordinator --host 0.0.0.0 --port 0 2>&1)
[ $? -eq 2 ] || fail "a coordinator on 0.0.0.0 without TLS was not refused: $out"
grep -q "refusing to listen on '0.0.0.0' without TLS" <<<"$out" || fail "no clear refusal: $out"
"$wsync" coordinator --host 0.0.0.0 --port 0 --insecure --port-file "$work/insecure-port" \
  >"$work/insecure.log" 2>&1 &
insecure=$!
pids+=("$insecure")
for _ in $(seq 200); do [ -s "$work/insecure-port" ] && break; sleep 0.05; done
[ -s "$work/insecure-port" ] || fail "--insecure coordinator did not start"
grep -q "without TLS (--insecure)" "$work/insecure.log" || fail "--insecure did not warn"
kill -TERM "$insecure"
wait "$insecure"

export WSYNC_TLS_CERT="$work/pki/localhost.pem" WSYNC_TLS_KEY="$work/pki/localhost.key" \
  WSYNC_TLS_CA="$work/pki/ca.pem"
layout=synthetic:1048576:4
"$wsync" coordinator --port 0 --port-file "$work/port" >"$work/coordinator.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.05; done
[ -s "$work/port" ] || fail "coordinator did not start"
grep -q "(TLS)" "$work/coordinator.log" || fail "coordinator does not say it listens with TLS"
addr="127.0.0.1:$(cat "$work/port")"
"$wsync" consumer --coordinator "$addr" --rank 0 --model "$layout" >"$work/consumer.log" 2>&1 &
pids+=("$!")
for _ in $(seq 200); do
  "$wsync" status --coordinator "$addr" --json 2>/dev/null | grep -q '"role":"consumer"' && break
  sleep 0.05
done
"$wsync" publisher --coordinator "$addr" --rank 0 --layout "$layout" --versions 2 --json \
  >"$work/publisher.log" 2>&1 || fail "publishing over TLS failed"
[ "$(grep -c '"phase":"committed"' "$work/publisher.log")" -eq 2 ] || fail "versions not committed"
out=$(env -u WSYNC_TLS_CERT -u WSYNC_TLS_KEY -u WSYNC_TLS_CA timeout 20 \
  "$wsync" status --coordinator "$addr" --json 2>&1) && fail "a peer without TLS got an answer: $out"
out=$(WSYNC_TLS_CERT="$work/rogue/localhost.pem" WSYNC_TLS_KEY="$work/rogue/localhost.key" \
  WSYNC_TLS_CA="$work/rogue/ca.pem" timeout 20 "$wsync" status --coordinator "$addr" --json 2>&1) &&
  fail "a peer with another CA's certificate got an answer: $out"
# The rogue peer trusting our CA but holding its own CA's certificate: refused too.
out=$(WSYNC_TLS_CERT="$work/rogue/localhost.pem" WSYNC_TLS_KEY="$work/rogue/localhost.key" \
  timeout 20 "$wsync" status --coordinator "$addr" --json 2>&1) &&
  fail "a peer with a certificate our CA did not sign got an answer: $out"
"$wsync" status --coordinator "$addr" --json >/dev/null 2>&1 ||
  fail "the coordinator did not survive the rogue peers"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
echo "cluster_tls: pass"
