#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test in the default ctest set.
# WSYNC_PRESET=asan or tsan runs the same tests under a sanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${WSYNC_PRESET:-default}"
scripts/bootstrap.sh
scripts/build.sh "$preset"
ctest --preset "$preset" -j2 --timeout 600
