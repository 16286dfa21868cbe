#!/usr/bin/env bash
# The main job: install what is missing, build, and run the shared-memory benchmark on the
# Qwen2.5-0.5B layout (publisher and consumer in separate processes). Extra arguments go to
# `wsync bench`, e.g. `scripts/run.sh --layout qwen2.5-1.5b`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/build.sh default
exec build/default/apps/wsync bench --mode shared-memory --layout qwen2.5-0.5b "$@"
