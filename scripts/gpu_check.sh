#!/usr/bin/env bash
# The checks that need a CUDA device, in one go (docs/transports.md, "GPU data plane"; docs/benchmark.md, "GPU modes"): the GPU
# test list, compute-sanitizer over the checksum kernels, and the benchmark rows. Runs built
# binaries only, so a machine with a GPU but without the build dependencies can run it.
#
# usage: scripts/gpu_check.sh [BIN_DIR [OUT_DIR]]
#   BIN_DIR  holds wsync, wsync_transports_test and wsync_runtime_test (default: their places in
#            build/default)
#   OUT_DIR  where the logs and rows go (default: .)
#
# Every step has its own timeout, so a stuck step cannot hold the run for long; a normal run
# takes about 110 s on an H200 (2026-11-27; an outer `timeout 330` is what that session used).
set -u
bin=${1:-}
out=${2:-.}
wsync=${bin:+$bin/wsync}
wsync=${wsync:-build/default/apps/wsync}
tests=${bin:+$bin/wsync_transports_test}
tests=${tests:-build/default/transports/wsync_transports_test}
runtime_tests=${bin:+$bin/wsync_runtime_test}
runtime_tests=${runtime_tests:-build/default/runtime/wsync_runtime_test}
mkdir -p "$out"
# A bundle from scripts/gpu_bundle.sh carries its libraries beside bin/.
if [ -n "$bin" ] && [ -d "$bin/../lib" ]; then
  export LD_LIBRARY_PATH="$(cd "$bin/../lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# NCCL: the system's, else the one a PyTorch install brings (nvidia-nccl wheels).
if [ -z "${WSYNC_NCCL_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then
  for py in python3 /usr/bin/python3; do
    lib=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) || continue
    [ -e "$lib" ] && export WSYNC_NCCL_LIBRARY=$lib && break
  done
fi
echo "NCCL: ${WSYNC_NCCL_LIBRARY:-libnccl.so.2 from the library path}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || exit 2
date -u +%FT%TZ

echo "== GPU tests"
timeout 150 "$tests" --gtest_filter='gpu*:device*:*cuda*:chunk*:nccl*' >"$out/gpu_tests.log" 2>&1
rc=$?
grep -E '^\[  (PASSED|FAILED) |imports \(s\)|Failure|Which is' "$out/gpu_tests.log"
echo "tests rc=$rc"
echo "== the torn-read test with CUDA kernels reading the active weights"
timeout 90 "$runtime_tests" --gtest_filter='*gpu_torn_read*' >"$out/gpu_torn_read.log" 2>&1
rc=$?
grep -E '^\[  (PASSED|FAILED) |Failure|Which is|digests that differ' "$out/gpu_torn_read.log"
echo "torn-read rc=$rc"

echo "== Python with CUDA tensors (python/tests/test_cuda.py)"
pkg=${bin:+$bin/../python}
pkg=${pkg:-build/default/python}
if PYTHONPATH=$pkg python3 -c 'import torch, wsync; assert torch.cuda.is_available()' \
  >"$out/python_cuda.log" 2>&1; then
  # WSYNC_BIN: the cluster tests' coordinator. The limit is above a cluster test's own (240 s):
  # one killed here would leave its processes running. About 25 s on an H200.
  WSYNC_BIN=$wsync PYTHONPATH=$pkg timeout 300 python3 -m pytest -q -p no:cacheprovider \
    python/tests/test_cuda.py \
    >>"$out/python_cuda.log" 2>&1
  echo "python rc=$? ($(tail -n 1 "$out/python_cuda.log"))"
else
  echo "python: skipped: $(tail -n 1 "$out/python_cuda.log") (an extension loads only into the"
  echo "        Python version it was built for: bundle with WSYNC_BUNDLE_PYTHON set to this one's)"
fi

if command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (memcheck) over the checksum kernels"
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$tests" --gtest_filter='gpu_test.*' \
    >"$out/sanitizer.log" 2>&1
  echo "sanitizer rc=$? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitizer.log") clean summaries)"
fi

echo "== a cluster over each GPU transport: coordinator, one publisher, two consumer processes;"
echo "   one consumer is SIGKILLed mid-run and restarted; then the status table"
export WSYNC_TOKEN=${WSYNC_TOKEN:-gpu-check}
for transport in cuda-ipc cuda-vmm; do
  dir=$(mktemp -d)
  "$wsync" coordinator --port-file "$dir/port" --update-deadline-ms 5000 >"$dir/coord.log" 2>&1 &
  coord=$!
  for _ in $(seq 50); do [ -s "$dir/port" ] && break; sleep 0.1; done
  at=127.0.0.1:$(cat "$dir/port")
  "$wsync" consumer --coordinator "$at" --rank 0 --model qwen2.5-0.5b --transport "$transport" >"$dir/c0.log" 2>&1 &
  c0=$!
  "$wsync" consumer --coordinator "$at" --rank 1 --model qwen2.5-0.5b --transport "$transport" >"$dir/c1.log" 2>&1 &
  c1=$!
  sleep 2
  "$wsync" publisher --coordinator "$at" --rank 0 --transport "$transport" --versions 40 \
    --interval-ms 50 --json >"$dir/pub.log" 2>&1 &
  pub=$!
  sleep 1
  kill -9 "$c1"
  sleep 0.5
  "$wsync" consumer --coordinator "$at" --rank 1 --model qwen2.5-0.5b --transport "$transport" >"$dir/c1b.log" 2>&1 &
  c1=$!
  timeout 60 tail --pid="$pub" -f /dev/null
  sleep 1
  "$wsync" status --coordinator "$at" >"$dir/status.log" 2>&1
  echo "$transport: $(grep -c '"committed"' "$dir/pub.log") of 40 versions committed; others:"
  grep -v '"committed"' "$dir/pub.log" | head -3
  head -8 "$dir/status.log"
  tail -n 2 "$dir/c1b.log" "$dir/c0.log"
  # Everything of this round ends, a publisher still running included: SIGTERM, ten seconds,
  # then SIGKILL, so a process that ignores the first cannot hold the script (and the device).
  kill "$pub" "$c0" "$c1" "$coord" 2>/dev/null
  for _ in $(seq 100); do
    alive=
    for p in "$pub" "$c0" "$c1" "$coord"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  kill -9 "$pub" "$c0" "$c1" "$coord" 2>/dev/null
  wait 2>/dev/null
  cp "$dir/pub.log" "$out/cluster-$transport-publisher.log"
  ls /dev/shm | grep -c '^wsync-' | sed 's/^/dev\/shm wsync entries left: /'
done

echo "== benchmark rows"
{
  for chunk in 65536 1048576; do
    timeout 45 "$wsync" bench --mode gpu-checksum --repeat 10 --checksum-chunk-bytes "$chunk"
  done
  for mode in cuda-ipc cuda-vmm; do
    timeout 60 "$wsync" bench --mode "$mode" --repeat 10 | tail -1
  done
  # Needs two GPUs (NCCL refuses two ranks on one); on one GPU its row says blocked, and why.
  timeout 60 "$wsync" bench --mode nccl --repeat 10 | tail -1
} | tee "$out/rows.jsonl"
