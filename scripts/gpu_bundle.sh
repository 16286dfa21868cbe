#!/usr/bin/env bash
# Gathers what scripts/gpu_check.sh runs into one folder that can travel to a machine with a GPU
# but without this project's build dependencies (CAF, UCX, cpp-httplib, toml++): the three
# binaries and the Python package (its extension built for this machine's /usr/bin/python3)
# without their debug sections, and every shared library they load from outside the C runtime.
# Builds the default preset first (with CUDA where the toolkit is found).
#
# The GPU machine's python3 may be another version than /usr/bin/python3 here, and an extension
# loads only into the version it was built for: WSYNC_BUNDLE_PYTHON names a second interpreter
# (its headers installed, e.g. a pyenv build of that version) whose extension is built in
# build/py-<version> and travels beside the first (Python picks the one its ABI tag names).
#
# usage: [WSYNC_BUNDLE_PYTHON=/path/to/python3.X] scripts/gpu_bundle.sh [OUT_DIR]
#        (default OUT_DIR: build/gpu-bundle)
# then, there: scripts/gpu_check.sh OUT_DIR/bin OUT_DIR_FOR_LOGS
set -euo pipefail
# The interpreter as an absolute path before the cd below (a bare name is looked up on PATH).
if [ -n "${WSYNC_BUNDLE_PYTHON:-}" ]; then
  given=$WSYNC_BUNDLE_PYTHON
  WSYNC_BUNDLE_PYTHON=$(realpath -s "$(command -v "$given")" 2>/dev/null) || {
    echo "gpu_bundle: WSYNC_BUNDLE_PYTHON=$given names no program" >&2
    exit 2
  }
fi
cd "$(dirname "$0")/.."
out=${1:-build/gpu-bundle}
scripts/build.sh default
if [ ! -e build/default/transports/libwsync_gpu_kernels.a ]; then
  echo "gpu_bundle: build/default was built without CUDA; install the CUDA toolkit and rebuild" >&2
  exit 2
fi
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
binaries=(build/default/apps/wsync build/default/transports/wsync_transports_test
  build/default/runtime/wsync_runtime_test)
for b in "${binaries[@]}"; do
  strip --strip-debug -o "$out/bin/$(basename "$b")" "$b"
done
mkdir -p "$out/python"
cp -r build/default/python/wsync "$out/python/"
if [ -n "${WSYNC_BUNDLE_PYTHON:-}" ]; then
  version=$("$WSYNC_BUNDLE_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  extra=build/py-$version
  cmake -S . -B "$extra" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWSYNC_ENABLE_WERROR=ON \
    -DWSYNC_WITH_PYTHON=ON -DWSYNC_PYTHON="$WSYNC_BUNDLE_PYTHON" >/dev/null
  cmake --build "$extra" -j2 --target wsync_python
  cp "$extra"/python/wsync/_wsync*.so "$out/python/wsync/"
fi
for so in "$out"/python/wsync/_wsync*.so; do
  [ -e "$so" ] || continue  # a build without the Python module
  strip --strip-debug "$so"
  binaries+=("$so")
done
# The C runtime and the loader come from the machine there; everything else travels.
ldd "${binaries[@]}" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
