#!/usr/bin/env bash
# The CLI explains itself and refuses bad input with a clear message and a non-zero exit.
set -uo pipefail
wsync="$1"
fail() { echo "cli: $*"; exit 1; }

help=$("$wsync" bench --help) || fail "bench --help exited non-zero"
for flag in --mode --smoke --layout --bytes --tensors --repeat --verify --copy-threads --slots \
            qwen2.5-0.5b qwen2.5-1.5b llama-3-8b; do
  grep -q -- "$flag" <<<"$help" || fail "bench --help does not mention $flag"
done
"$wsync" --help >/dev/null || fail "--help exited non-zero"

out=$("$wsync" bench --mode carrier-pigeon 2>&1) && fail "unknown mode accepted"
grep -q "carrier-pigeon" <<<"$out" || fail "unknown mode not named: $out"

out=$("$wsync" bench --layout gpt-9 --smoke 2>&1)
[ $? -eq 1 ] || fail "unknown layout should exit 1"
grep -q '"status":"fail"' <<<"$out" || fail "unknown layout not reported as fail: $out"
grep -q 'qwen2.5-0.5b' <<<"$out" || fail "unknown layout error does not list known layouts"

out=$("$wsync" bench --layout qwen2.5-0.5b --bytes 10 2>&1) && fail "--layout with --bytes accepted"
out=$("$wsync" bench --verify maybe 2>&1) && fail "--verify maybe accepted"
# A flag the chosen mode does not read is a fail row naming it, not silently ignored.
for args in "--mode cluster --verify off" "--mode cluster --slots 8" "--mode fanout --dir /tmp" \
  "--mode local --kill-leader" "--mode local --consumers 8" "--mode cluster --plan chain" \
  "--mode gpu-checksum --layout llama-3-8b"; do
  # shellcheck disable=SC2086
  out=$("$wsync" bench $args 2>&1) && fail "bench $args accepted"
  flag=$(awk '{print $3}' <<<"$args")
  grep -q -- "\"error\":\"$flag " <<<"$out" || fail "bench $args: not named: $out"
done
# The fail row says whether it was a smoke run, as every row does.
out=$("$wsync" bench --mode local --kill-leader --smoke 2>&1)
grep -q '"smoke":true' <<<"$out" || fail "fail row without smoke: $out"
# Numbers: refused with the option named, never a crash (rc 134) or a silent wrap-around.
for bad in abc 99999999999999999999999 5000; do
  out=$("$wsync" bench --checksum-chunk-bytes "$bad" 2>&1)
  rc=$?
  [ $rc -ne 0 ] && [ $rc -lt 128 ] || fail "--checksum-chunk-bytes $bad: exit $rc: $out"
  grep -q -- "--checksum-chunk-bytes" <<<"$out" || fail "--checksum-chunk-bytes $bad not named: $out"
done
for bad in 0 -1; do
  out=$(WSYNC_TOKEN=t "$wsync" publisher --rank 0 --versions "$bad" --dump-config 2>&1) &&
    fail "--versions $bad accepted"
  grep -q -- "--versions" <<<"$out" || fail "--versions $bad not named: $out"
done
out=$("$wsync" consumer --standalone --poll-ms 0 --dump-config 2>&1) && fail "--poll-ms 0 accepted"
grep -q -- "--poll-ms" <<<"$out" || fail "--poll-ms 0 not named: $out"
# Options the run would not act on are refused, naming what turns them on.
for case in "--http-port 9000|--http-\*" "--world-size 2|--world-size" "--poll-ms 50|--poll-ms" \
            "--enable-weight-transfer --cuda-device 1|--cuda-device"; do
  args=${case%%|*}
  # shellcheck disable=SC2086
  out=$(WSYNC_TOKEN=t timeout 20 "$wsync" consumer --coordinator 127.0.0.1:9 --model m $args 2>&1)
  [ $? -eq 2 ] || fail "consumer $args: ignored instead of refused: $out"
  grep -q -- "${case#*|}" <<<"$out" || fail "consumer $args: option not named: $out"
done
for bad in 127.0.0.1:9abc :7700 127.0.0.1:+7700 127.0.0.1:0 127.0.0.1:65536; do
  out=$(WSYNC_TOKEN=t "$wsync" status --coordinator "$bad" 2>&1) && fail "--coordinator $bad accepted"
  grep -q "host:port" <<<"$out" || fail "--coordinator $bad: no host:port hint: $out"
done
# Configuration: the shipped files load, flags override them, the launcher's RANK / Slurm's
# SLURM_PROCID fill in ranks, unknown keys and wrong types are refused naming the key, and the
# token is never dumped.
configs="$(dirname "$0")/../../configs"
for f in "$configs"/*.toml; do
  WSYNC_TOKEN=secret-token "$wsync" coordinator --config "$f" --dump-config >/dev/null ||
    fail "$f does not load"
done
dump=$(WSYNC_TOKEN=secret-token "$wsync" coordinator --config "$configs/local.toml" --port 7801 --dump-config)
grep -q '^port=7801' <<<"$dump" || fail "flag does not override the file: $dump"
grep -q '^host="127.0.0.1"' <<<"$dump" || fail "file value missing: $dump"
grep -q 'secret-token' <<<"$dump" && fail "--dump-config prints the token"
dump=$(WSYNC_HTTP_TOKEN=http-secret "$wsync" consumer --standalone --dump-config)
grep -q 'http-secret' <<<"$dump" && fail "--dump-config prints the HTTP token: $dump"
grep -q '^# http-token is set' <<<"$dump" || fail "--dump-config does not say the HTTP token is set: $dump"
# A dump loads back as it is (empty options are written commented out), and dumps the same again.
for args in "coordinator" "consumer" "consumer --no-node-leader" "publisher --rank 0" \
  "status --coordinator 127.0.0.1:7700" "bench"; do
  dumped=$(mktemp)
  # shellcheck disable=SC2086
  WSYNC_TOKEN=t "$wsync" $args --dump-config >"$dumped" || fail "$args --dump-config failed"
  sub=${args%% *}
  out=$(WSYNC_TOKEN=t "$wsync" $sub --config "$dumped" --dump-config 2>&1) ||
    fail "$sub: its own dump does not load: $out"
  # A value survives the trip: the reloaded dump, loaded again, dumps the same (the first may
  # differ in spelling only: a list default is printed as one string).
  echo "$out" >"$dumped"
  again=$(WSYNC_TOKEN=t "$wsync" $sub --config "$dumped" --dump-config 2>&1)
  [[ "$again" == "$out" ]] || fail "$args: a reloaded dump differs: $(diff <(echo "$again") "$dumped")"
  rm -f "$dumped"
done
# An unusable TMPDIR is the demo's error, not an abort.
out=$(TMPDIR=/nonexistent-wsync-tmp "$wsync" demo 2>&1)
rc=$?
[ $rc -eq 1 ] || fail "demo with no TMPDIR: exit $rc: $out"
grep -q "no temporary directory (TMPDIR)" <<<"$out" || fail "demo with no TMPDIR: $out"
dump=$(WSYNC_TOKEN=t "$wsync" consumer --no-node-leader --dump-config)
grep -q '^no-node-leader=true' <<<"$dump" || fail "--no-node-leader dumps inverted: $dump"
dump=$(SLURM_PROCID=5 WSYNC_TOKEN=t "$wsync" publisher --config "$configs/local.toml" --dump-config)
grep -q '^rank=5' <<<"$dump" || fail "SLURM_PROCID not used as the rank: $dump"
bad=$(mktemp)
printf '[coordinator]
prot = 1
' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" 2>&1) && fail "unknown key accepted"
grep -q "config: unknown setting coordinator.prot" <<<"$out" || fail "unknown key not named: $out"
printf '[coordinatr]\nport = 1\n' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" 2>&1) && fail "unknown section accepted"
grep -q "config: unknown section \[coordinatr\]" <<<"$out" || fail "unknown section not named: $out"
printf '[coordinator]\nport = 7700 junk\n' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" 2>&1) && fail "a TOML syntax error accepted"
grep -q "config: line 2, column" <<<"$out" || fail "a TOML syntax error not located: $out"
printf '[coordinator]\nport = 7700.0\n' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" 2>&1) && fail "a float taken for an integer"
grep -q "config: coordinator.port: a floating-point number" <<<"$out" || fail "a float not named: $out"
printf '[coordinator.tls]\ncert = "x"\n' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" 2>&1) && fail "a nested table accepted"
grep -q "coordinator.tls" <<<"$out" || fail "a nested table not named: $out"
# "--" is a valid TOML key, and CLI11's mark for "end of section": found by fuzz.toml_config.
printf '[coordinator]\n--= false\nport = 7700\n' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" --dump-config 2>&1) && fail "key -- accepted"
grep -q "config: coordinator.--: not a setting name" <<<"$out" || fail "key -- not named: $out"
printf '[coordinator]
port = "abc"
' >"$bad"
out=$(WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" 2>&1) && fail "wrong type accepted"
grep -q -- "--port" <<<"$out" || fail "wrong type not named: $out"
printf '[coordinator]
token = "in-a-file"
' >"$bad"
WSYNC_TOKEN=t "$wsync" coordinator --config "$bad" >/dev/null 2>&1 && fail "token accepted from a file"
rm -f "$bad"
out=$(env -u WSYNC_TOKEN "$wsync" coordinator --port 0 2>&1) && fail "coordinator started without a token"
grep -q "token" <<<"$out" || fail "missing token not explained: $out"
out=$("$wsync" publisher --standalone --rank 0 --manifest-out /dev/null --transport ucx 2>&1) &&
  fail "publisher --standalone accepted a transport it does not use"
grep -q -- "--standalone publishes over shared memory or file-mmap only" <<<"$out" ||
  fail "publisher --standalone: ignored transport not explained: $out"
for flag in "--json" "--interval-ms 5" "--coordinator 127.0.0.1:1" "--outcome-timeout-ms 5000" \
  "--layout qwen2.5-1.5b --safetensors /dev/null"; do
  # shellcheck disable=SC2086
  out=$("$wsync" publisher --standalone --rank 0 --manifest-out /dev/null $flag 2>&1) &&
    fail "publisher --standalone accepted $flag, which it ignores"
  grep -q -- "${flag%% *}:" <<<"$out" || fail "publisher --standalone $flag: not explained: $out"
done
out=$(WSYNC_TOKEN=t "$wsync" publisher --rank 0 --coordinator 127.0.0.1:1 --manifest-out m.jsonl 2>&1) &&
  fail "publisher accepted --manifest-out without --standalone"
grep -q -- "--manifest-out: only --standalone" <<<"$out" || fail "--manifest-out not explained: $out"
out=$("$wsync" consumer --standalone --enable-weight-transfer --count 2 2>&1) &&
  fail "consumer --standalone accepted --count 2"
grep -q -- "--count 2: a standalone consumer is one rank" <<<"$out" || fail "--count 2 not explained: $out"
out=$("$wsync" publisher --standalone --rank 0 --manifest-out /dev/null --versions 65 2>&1) &&
  fail "publisher --standalone accepted more versions than it has slots"
grep -q -- "--versions 65: --standalone over shared memory holds every version in its own slot" <<<"$out" ||
  fail "publisher --standalone --versions 65 not explained: $out"
# file-mmap without its directory: both standalone sides name the missing option.
out=$("$wsync" publisher --standalone --rank 0 --transport file-mmap 2>&1) &&
  fail "publisher --standalone --transport file-mmap ran without dir"
grep -q "file-mmap option dir: required" <<<"$out" || fail "missing dir not explained: $out"
out=$("$wsync" consumer --standalone --rank 0 --transport file-mmap 2>&1) &&
  fail "consumer --standalone --transport file-mmap ran without dir"
grep -q "file-mmap option dir: required" <<<"$out" || fail "missing dir not explained: $out"
out=$("$wsync" consumer --standalone --transport file-mmap --transport-option dir=/tmp \
  --enable-weight-transfer 2>&1) && fail "consumer --standalone file-mmap took HTTP too"
grep -q "polls the directory" <<<"$out" || fail "file-mmap with HTTP not explained: $out"
out=$("$wsync" consumer --standalone --enable-weight-transfer --transport-option dir=/tmp 2>&1) &&
  fail "consumer --standalone over HTTP took --transport-option it would ignore"
grep -q "init_info.transport_options" <<<"$out" || fail "ignored transport option not explained: $out"
# Captured first: with pipefail, grep -q leaving early would fail the pipeline on SIGPIPE.
help=$("$wsync" consumer --help) || fail "consumer --help exited non-zero"
grep -q "polls DIR/CURRENT" <<<"$help" || fail "consumer --help does not explain file-mmap"
grep -q "nccl: consumers=" <<<"$help" || fail "consumer --help does not explain nccl's options"
out=$(WSYNC_TOKEN=t "$wsync" consumer --coordinator 127.0.0.1:1 --model m --transport nccl \
  --count 2 2>&1) && fail "consumer took two nccl ranks in one process"
grep -q "one rank per process" <<<"$out" || fail "two nccl ranks not explained: $out"
out=$("$wsync" consumer --standalone --rank -3 --transport file-mmap --transport-option dir=/tmp 2>&1) &&
  fail "consumer took a negative rank"
grep -q -- "--rank -3: must be from 0" <<<"$out" || fail "negative consumer rank not explained: $out"
# A port file it cannot write: the launcher would wait for it for good, so the coordinator stops.
out=$(timeout 20 "$wsync" coordinator --token t --port-file /nonexistent-wsync/port 2>&1) &&
  fail "coordinator ran without the port file it was asked for"
grep -q -- "--port-file: cannot write /nonexistent-wsync/port.tmp" <<<"$out" ||
  fail "unwritable port file not explained: $out"
# A port file a dead run left is replaced at start and removed at the end.
work=$(mktemp -d)
echo 1 >"$work/port"
"$wsync" coordinator --token t --port-file "$work/port" >"$work/log" 2>&1 &
coord=$!
for _ in $(seq 100); do [ "$(cat "$work/port" 2>/dev/null)" != 1 ] && [ -s "$work/port" ] && break; sleep 0.05; done
port=$(cat "$work/port" 2>/dev/null)
kill -TERM "$coord"
wait "$coord"
[ -n "$port" ] && [ "$port" != 1 ] || fail "the stale port file was not replaced (read '$port')"
[ ! -e "$work/port" ] || fail "the port file outlived its coordinator"
rm -rf "$work"
echo "cli: pass"
