#!/usr/bin/env bash
# Fuzzes every target in fuzz/targets (or those named) for SECONDS each with libFuzzer, after
# installing Clang 14 + libFuzzer and building the fuzz preset. Prints one JSON row per target:
# executions, corpus growth, and findings (a crashing input is kept in build/fuzz/findings/).
# New inputs go to build/fuzz/corpus/<target>; --merge folds those that add coverage into the
# checked-in fuzz/corpus/<target>, which ctest replays as regression tests.
#
#   scripts/fuzz.sh [--merge] [SECONDS] [TARGET...]     (SECONDS defaults to 60)
set -euo pipefail
cd "$(dirname "$0")/.."

merge=0
if [ "${1:-}" = "--merge" ]; then merge=1; shift; fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
seconds=60
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then seconds=$1; shift; fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in fuzz/targets/*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi

scripts/bootstrap.sh --fuzz
[ -f build/fuzz/CMakeCache.txt ] || cmake --preset fuzz >/dev/null
cmake --build --preset fuzz

found=0
for t in "${targets[@]}"; do
  bin=build/fuzz/fuzz/fuzz_$t
  [ -x "$bin" ] || { echo "fuzz: no target $t (fuzz/targets/$t.cpp)" >&2; exit 2; }
  work=build/fuzz/corpus/$t findings=build/fuzz/findings/$t
  mkdir -p "$work" "$findings"
  log=build/fuzz/$t.log
  before=$(find "$work" fuzz/corpus/"$t" -type f | wc -l)
  known=$(find "$findings" -type f | wc -l)
  set +e
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$findings/" "$work" fuzz/corpus/"$t" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  after=$(find "$work" fuzz/corpus/"$t" -type f | wc -l)
  crashes=$(( $(find "$findings" -type f | wc -l) - known ))
  [ "$rc" -eq 0 ] || found=1
  printf '{"target": "%s", "seconds": %s, "executions": %s, "corpus_before": %s, "corpus_after": %s, "findings": %s, "exit": %s, "log": "%s"}\n' \
    "$t" "$seconds" "${execs:-0}" "$before" "$after" "$crashes" "$rc" "$log"
  if [ "$merge" -eq 1 ]; then
    "$bin" -merge=1 fuzz/corpus/"$t" "$work" >>"$log" 2>&1
  fi
done
exit $found
