#!/usr/bin/env bash
# `wsync demo --json`: every consumer acknowledges every version; the last line is the status
# object (docs/cluster.md) with status pass; ranks that stop in order are logged as leaving; no
# process and no /dev/shm segment is left behind.
set -uo pipefail
wsync="$1"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() { echo "demo: $*"; tail -n 30 "$out"; exit 1; }
# Certificates exported for a real cluster (docs/cluster.md) must not reach the loopback demo
# (files that exist, as the flags check, but hold no certificate: a rank given them fails).
WSYNC_TLS_CERT="$out" WSYNC_TLS_KEY="$out" WSYNC_TLS_CA="$out" \
  "$wsync" demo --json --layout synthetic:16777216:24 --versions 5 >"$out" 2>&1 || fail "exit $?"
last=$(tail -n 1 "$out")
for field in '"status":"pass"' '"versions":5' '"committed_version":5' '"ranks":['; do
  case "$last" in *"$field"*) ;; *) fail "missing $field" ;; esac
done
acked=$(grep -o '"active_weight_version":5,[^}]*"role":"consumer","state":"acknowledged"' <<<"$last" | wc -l)
[ "$acked" -eq 4 ] || fail "expected 4 consumers acknowledged at version 5, got $acked"
# Ranks wait for their endpoints to stop, so the coordinator mostly learns user_shutdown and logs
# "left" at info; CAF may still close a connection before that message leaves (then it warns
# about a lost link), so this asks for the info line, not for the absence of every warning.
grep -q 'wsync info: coordinator: .* rank [0-9]* left$' "$out" || fail "no rank was logged as leaving in order"
if pgrep -f "wsync (coordinator|consumer|publisher)" >/dev/null; then
  sleep 1
  pgrep -af "wsync (coordinator|consumer|publisher)" && fail "processes left behind"
fi

# Stopped mid-run: SIGTERM (or SIGHUP) to the demo alone stops its cluster in order (no /dev/shm left), and a
# demo killed outright takes its processes with it (they get SIGTERM when their parent dies).
shm_count() { find /dev/shm -maxdepth 1 -name 'wsync-*' 2>/dev/null | wc -l; }
before=$(shm_count)
for sig in TERM HUP KILL; do
  "$wsync" demo --layout synthetic:16777216:8 --versions 1000 >"$out" 2>&1 &
  demo=$!
  for _ in $(seq 100); do grep -q 'version 3 committed' "$out" && break; sleep 0.1; done
  grep -q 'version 3 committed' "$out" || fail "SIG$sig: the long demo did not get going"
  kill -"$sig" "$demo"
  for _ in $(seq 150); do kill -0 "$demo" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$demo" 2>/dev/null && fail "SIG$sig: the demo still runs 15 s later"
  wait "$demo" 2>/dev/null
  if [ "$sig" != KILL ]; then  # HUP: the terminal or ssh session that ran it closed
    grep -q "error: stopped by SIGINT, SIGTERM or SIGHUP" "$out" || fail "SIG$sig: the demo did not say it was stopped"
  fi
  for _ in $(seq 50); do pgrep -f "wsync (coordinator|consumer|publisher)" >/dev/null || break; sleep 0.2; done
  pgrep -af "wsync (coordinator|consumer|publisher)" && fail "SIG$sig: processes left behind"
  [ "$(shm_count)" -le "$before" ] || { ls /dev/shm; fail "SIG$sig: /dev/shm entries left behind"; }
  # A demo killed outright cannot remove its private folder (the next launcher sweeps it after a
  # day): the test does, so that runs of the suite leave nothing.
  if [ "$sig" = KILL ]; then rm -rf "${TMPDIR:-/tmp}/wsync-cluster-$demo-"*; fi
done

# A /dev/shm too small for the update (a container's is 64 MiB unless --shm-size says more): the
# publish fails in words that say so and how to fix it, not with SIGBUS or a bare errno. Needs a
# private mount namespace (root).
if unshare -m true 2>/dev/null; then
  unshare -m bash -c 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$0" demo --layout synthetic:33554432:8 --versions 1' \
    "$wsync" >"$out" 2>&1 && fail "small /dev/shm: the demo passed"
  grep -q 'no room for [0-9]* MiB in /dev/shm ([0-9]* MiB free of 8 MiB); give /dev/shm more room' "$out" ||
    fail "small /dev/shm: the publisher did not say /dev/shm was full"
else
  echo "demo: no private mount namespace here (needs root): the small /dev/shm check did not run"
fi
echo "demo: pass"
