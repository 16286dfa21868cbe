#!/usr/bin/env bash
# file-mmap without a coordinator, on a tmpfs or a disk directory ($2): a standalone publisher
# and polling standalone consumers as separate processes. Checks that every version is
# installed in order; that the segment files are reused (same inodes) by a restarted publisher;
# that a writer killed between data and the CURRENT rename leaves the previous version readable
# and its half-written buffer ignored; that a reader killed while holding a buffer (SIGKILL) or
# frozen (SIGSTOP, its heartbeat stale) gives the buffer back to the writer (the frozen one's
# files are left to it: the writer writes new ones). Exits 77 (skipped)
# when the machine has no directory of that kind.
wsync="$1"
kind="$2"
name="file_mmap($kind)"
source "$(dirname "$0")/processes.sh"

fs_type() { stat -f -c %T "$1" 2>/dev/null; }
case "$kind" in
  tmpfs)
    # Not "wsync-*": /dev/shm names of that form belong to the shared-memory leak checks.
    base=/dev/shm
    [ "$(fs_type $base)" = tmpfs ] && [ -w $base ] || { echo "$name: skipped: no writable tmpfs at /dev/shm"; exit 77; } ;;
  disk)
    base=""
    for b in /var/tmp "$PWD"; do
      t=$(fs_type "$b")
      [ -n "$t" ] && [ "$t" != tmpfs ] && [ "$t" != ramfs ] && [ -w "$b" ] && { base=$b; break; }
    done
    [ -n "$base" ] || { echo "$name: skipped: no writable disk directory (/var/tmp, $PWD)"; exit 77; } ;;
  *) echo "usage: file_mmap.sh WSYNC tmpfs|disk"; exit 2 ;;
esac
dir=$(mktemp -d "$base/fmm-it.XXXXXX")
trap 'cleanup; rm -rf "$dir"' EXIT

layout=synthetic:4194304:8
opts=(--transport file-mmap --transport-option "dir=$dir")
versions_of() { grep -o 'active version [0-9]*' "$1" | awk '{print $3}' | tr '\n' ' '; }
wait_for_version() {  # log, version: up to 20 s
  for _ in $(seq 400); do grep -q "active version $2 " "$1" && return 0; sleep 0.05; done
  return 1
}
publish() {  # log, first version, count, extra args...
  local log=$1 first=$2 count=$3
  shift 3
  "$wsync" publisher --standalone "${opts[@]}" --rank 0 --layout "$layout" \
    --first-version "$first" --versions "$count" --interval-ms 300 "$@" >>"$work/$log" 2>&1
}
inodes() { ls -i "$dir"/buffer-*/segment-* | awk '{print $1}' | sort | tr '\n' ' '; }

# 1. Two processes: the consumer installs every version, in order.
"$wsync" consumer --standalone "${opts[@]}" --rank 1 --poll-ms 50 >"$work/consumer1.log" 2>&1 &
c1=$!
pids+=("$c1")
publish publisher.log 1 3 || fail "the publisher failed"
wait_for_version "$work/consumer1.log" 3 || fail "consumer 1 did not install version 3"
before=$(inodes)
files=$(ls "$dir"/buffer-*/ | grep -c '^segment-')
[ "$files" -gt 0 ] || fail "no segment files in $dir"

# 2. A restarted publisher writes into the same files.
publish publisher.log 4 3 || fail "the restarted publisher failed"
wait_for_version "$work/consumer1.log" 6 || fail "consumer 1 did not install version 6"
[ "$(versions_of "$work/consumer1.log")" = "1 2 3 4 5 6 " ] ||
  fail "consumer 1 installed: $(versions_of "$work/consumer1.log")"
[ "$(inodes)" = "$before" ] || fail "segment files were recreated: $before -> $(inodes)"
[ "$(ls "$dir"/buffer-*/ | grep -c '^segment-')" = "$files" ] || fail "the file count changed"

# 3. The writer dies between its data and the rename of CURRENT.
WSYNC_FILE_MMAP_CRASH=before-rename publish crash.log 7 1
rc=$?
[ $rc -eq 86 ] || fail "the crashing publisher exited $rc, expected 86"
grep -q 'before the rename' "$work/crash.log" || fail "the crash point was not reached"
[ -s "$dir/CURRENT.tmp" ] || fail "no CURRENT.tmp left by the crash"
grep -q '"weight_version":6' "$dir/CURRENT" || fail "CURRENT no longer names version 6"
sleep 0.3  # several polls: the half-written buffer must not be picked up
grep -q 'active version 7' "$work/consumer1.log" && fail "consumer 1 installed the crashed version"
# A reader that starts now gets the previous version, intact (verified against its checksums).
"$wsync" consumer --standalone "${opts[@]}" --rank 2 --poll-ms 50 >"$work/consumer2.log" 2>&1 &
c2=$!
pids+=("$c2")
wait_for_version "$work/consumer2.log" 6 || fail "consumer 2 did not install version 6 after the crash"
publish publisher.log 7 1 || fail "the publisher after the crash failed"
wait_for_version "$work/consumer1.log" 7 || fail "consumer 1 did not install version 7"
wait_for_version "$work/consumer2.log" 7 || fail "consumer 2 did not install version 7"
kill -TERM "$c1" "$c2"
wait "$c1" || fail "consumer 1 did not stop cleanly"
wait "$c2" || fail "consumer 2 did not stop cleanly"
grep -q 'stopping; active version 7' "$work/consumer1.log" || fail "consumer 1 did not report its stop"
[ -z "$(ls "$dir/leases")" ] || fail "stopped consumers left leases: $(ls "$dir/leases")"

# 4. A reader killed while it holds a buffer: its lease names a dead pid, the writer takes the
#    buffer back at once.
"$wsync" consumer --standalone "${opts[@]}" --rank 3 --poll-ms 50 >"$work/consumer3.log" 2>&1 &
c3=$!
pids+=("$c3")
wait_for_version "$work/consumer3.log" 7 || fail "consumer 3 did not install version 7"
kill -KILL "$c3"
wait "$c3" 2>/dev/null
ls "$dir/leases" | grep -q '\.lease$' || fail "the killed reader left no lease to expire"
publish publisher.log 8 2 || fail "the publisher could not take back the killed reader's buffer"
grep -q 'freed from the lease of rank 3' "$work/publisher.log" ||
  fail "the publisher did not say it freed rank 3's lease"

# 5. A frozen reader: alive, but its heartbeat stops; the lease expires after lease_timeout_ms.
"$wsync" consumer --standalone "${opts[@]}" --transport-option lease_timeout_ms=600 --rank 4 \
  --poll-ms 50 >"$work/consumer4.log" 2>&1 &
c4=$!
pids+=("$c4")
wait_for_version "$work/consumer4.log" 9 || fail "consumer 4 did not install version 9"
kill -STOP "$c4"
publish publisher.log 10 2 --transport-option lease_timeout_ms=600 ||
  fail "the publisher could not take back the frozen reader's buffer"
grep -q 'freed from the lease of rank 4.*heartbeat is older than lease_timeout_ms=600' \
  "$work/publisher.log" || fail "the frozen reader's lease did not expire by its heartbeat"
# It still runs here and serves views of what it mapped: the writer leaves those files to it.
grep -q 'may still be mapped by rank 4 .*its files are left to it' "$work/publisher.log" ||
  fail "the frozen reader's files were rewritten in place: $(grep -i 'rank 4' "$work/publisher.log")"
grep -q '"weight_version":11' "$dir/CURRENT" || fail "CURRENT does not name version 11"
kill -KILL "$c4"
# A held buffer without expiry: the message users see.
"$wsync" consumer --standalone "${opts[@]}" --rank 5 --poll-ms 50 >"$work/consumer5.log" 2>&1 &
c5=$!
pids+=("$c5")
wait_for_version "$work/consumer5.log" 11 || fail "consumer 5 did not install version 11"
kill -STOP "$c5"
publish publisher.log 12 1 || fail "version 12 goes to the free buffer"
# The writer's lease timeout outlasts its 10 s wait here, so the frozen reader keeps its hold.
publish held.log 13 1 --transport-option lease_timeout_ms=60000 &&
  fail "version 13 was published over a held buffer"
grep -q 'no free buffer: held by rank 5' "$work/held.log" || fail "no 'held by rank 5' in: $(tail -n 2 "$work/held.log")"
kill -KILL "$c5"
echo "$name: pass"
