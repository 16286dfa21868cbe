#!/usr/bin/env bash
# The main job: install what is missing, build, and run the local cluster demo — a coordinator,
# 2 publisher ranks and 4 consumer ranks as separate processes on loopback, 5 versions of the
# Qwen2.5-0.5B layout over shared memory, then the per-rank table. Extra arguments go to
# `wsync demo`, e.g. `scripts/run.sh --json` or `scripts/run.sh --layout qwen2.5-1.5b`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/build.sh default
exec build/default/apps/wsync demo "$@"
