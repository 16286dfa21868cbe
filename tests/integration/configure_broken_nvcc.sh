#!/usr/bin/env bash
# WSYNC_WITH_CUDA=AUTO with /usr/local/cuda/bin/nvcc present but unable to compile (a host
# compiler it does not support, a partial toolkit): the configure turns the GPU parts off and
# says so, instead of failing. The broken nvcc is bind-mounted in a private mount namespace, so
# this needs root and unshare; exits 77 (skipped) without them or without /usr/local/cuda.
set -uo pipefail
src="$1"
[ -e /usr/local/cuda/bin/nvcc ] || { echo "skip: no /usr/local/cuda/bin/nvcc here"; exit 77; }
[ "$(id -u)" -eq 0 ] || { echo "skip: needs root (a private mount namespace)"; exit 77; }
unshare -m true 2>/dev/null || { echo "skip: unshare -m is not allowed here"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/nvcc" <<'NVCC'
#!/bin/sh
case "$*" in
  *--version*) echo "Cuda compilation tools, release 12.4, V12.4.99"; exit 0 ;;
esac
echo "broken nvcc: cannot compile" >&2
exit 1
NVCC
chmod +x "$work/nvcc"
env -u CUDACXX unshare -m bash -c "mount --bind '$work/nvcc' /usr/local/cuda/bin/nvcc &&
  cmake -S '$src' -B '$work/build' -G Ninja -DWSYNC_WITH_CUDA=AUTO" >"$work/log" 2>&1
rc=$?
[ $rc -eq 0 ] || { tail -n 20 "$work/log"; echo "configure_broken_nvcc: configure failed ($rc)"; exit 1; }
grep -q "wsync: no CUDA toolkit found: the GPU transports answer blocked" "$work/log" || {
  grep "wsync:" "$work/log"
  echo "configure_broken_nvcc: CUDA was not turned off"
  exit 1
}
echo "configure_broken_nvcc: pass"
