# Sourced by the multi-process test scripts: a work folder, the processes started (killed on
# exit, also on failure: a script that means to check a clean stop sends SIGTERM itself first),
# fail() that shows every log, wait_for_file() and check_no_segments().
# Set `name` before sourcing: fail() prefixes its messages with it.
set -uo pipefail
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "$name: $*"
  for f in "$work"/*.log; do echo "--- $f"; tail -n 15 "$f"; done
  exit 1
}
wait_for_file() {  # path: waits up to 10 s for it to exist and be non-empty
  for _ in $(seq 200); do [ -s "$1" ] && return 0; sleep 0.05; done
  return 1
}
# No shared-memory segment of ours may outlive the processes.
check_no_segments() {
  ls /dev/shm | grep -q '^wsync-' && fail "a shared-memory segment was left behind: $(ls /dev/shm | grep '^wsync-')"
  return 0
}
# Writes a safetensors file: path, header JSON, bytes of random tensor data after it.
write_safetensors() {
  local len=${#2}
  {
    for i in 0 1 2 3 4 5 6 7; do printf "\\x$(printf %02x $(( (len >> (8 * i)) & 255 )))"; done
    printf '%s' "$2"
    head -c "$3" /dev/urandom
  } >"$1"
}
# Waits up to 10 s until the coordinator at $2 lists at least $3 consumer ranks ($1: wsync).
wait_for_consumers() {
  for _ in $(seq 200); do
    [ "$("$1" status --coordinator "$2" --json | grep -o '"role":"consumer"' | wc -l)" -ge "$3" ] && return 0
    sleep 0.05
  done
  return 1
}
