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
echo "cli: pass"
