#!/usr/bin/env bash
# TLS between cluster processes (CAF's OpenSSL module): a coordinator, a consumer and a publisher
# with certificates from a test CA commit a version; a peer without TLS cannot reach the
# coordinator at all.
wsync=$(readlink -f "$1")
name=cluster_tls
source "$(dirname "$0")/processes.sh"
command -v openssl >/dev/null || fail "openssl is not installed (scripts/bootstrap.sh installs it)"
cd "$work"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=wsync-test-ca" \
  -keyout ca.key -out ca.pem >/dev/null 2>&1 || fail "cannot make a CA"
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout node.key -out node.csr \
  >/dev/null 2>&1 || fail "cannot make a key"
openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out node.pem \
  >/dev/null 2>&1 || fail "cannot sign the certificate"
export WSYNC_TOKEN=tls-token WSYNC_TLS_CERT="$work/node.pem" WSYNC_TLS_KEY="$work/node.key" \
  WSYNC_TLS_CA="$work/ca.pem"
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
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait
echo "cluster_tls: pass"
