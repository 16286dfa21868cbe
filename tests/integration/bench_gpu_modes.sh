#!/usr/bin/env bash
# The GPU modes of `wsync bench --smoke`: each prints exactly one JSON row. Where no GPU work can
# run (no CUDA in the build, or no device) the row is "blocked" with the cause and the exit code
# is 2; a row that passes (a machine with a GPU; nccl needs two) carries its baseline.
set -uo pipefail
wsync="$1"
fail() { echo "bench_gpu_modes: $*"; exit 1; }
for mode in cuda-ipc cuda-vmm nccl gpu-checksum; do
  out=$("$wsync" bench --smoke --mode "$mode")
  rc=$?
  [ "$(wc -l <<<"$out")" = 1 ] || fail "$mode: expected one row, got: $out"
  case "$out" in *'"mode":"'"$mode"'"'*) ;; *) fail "$mode: row without its mode: $out" ;; esac
  case "$out" in
    *'"status":"blocked"'*)
      [ "$rc" = 2 ] || fail "$mode: blocked row but exit code $rc"
      case "$out" in *'"blocker":"blocked: '*) ;; *) fail "$mode: blocker without its cause: $out" ;; esac
      echo "$mode: $out" ;;
    *'"status":"pass"'*)
      [ "$rc" = 0 ] || fail "$mode: pass row but exit code $rc"
      case "$out" in *'"name":"cudaMemcpy-d2d"'*'"ratio_to_baseline":'*) ;; *) fail "$mode: no baseline: $out" ;; esac
      echo "$mode: $out" ;;
    *) fail "$mode: neither blocked nor pass (rc $rc): $out" ;;
  esac
done
