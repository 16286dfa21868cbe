#!/usr/bin/env bash
# Fails listing every file clang-format would change.
set -uo pipefail
clang_format="$1"
files=$(git ls-files '*.cpp' '*.hpp' '*.cu' 2>/dev/null || find . -path ./build -prune -o \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' \) -print)
bad=0
for f in $files; do
  if ! "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "needs clang-format: $f"
    bad=1
  fi
done
exit $bad
