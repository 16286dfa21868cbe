#!/usr/bin/env bash
# Installs the Debian 12 packages wsync needs to build and test. Idempotent: installs only what
# is missing, and runs `apt-get update` once, only when something is missing. Run as root.
# --fuzz adds Clang 14 and libFuzzer, for the fuzz preset (scripts/fuzz.sh).
set -euo pipefail

packages=(
  # toolchain
  g++ cmake ninja-build pkg-config ccache clang-format openssl
  # libraries (cmake/wsync_dependencies.cmake finds them)
  nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libxxhash-dev libcaf-dev libcpp-httplib-dev
  libssl-dev
  # tests
  libgtest-dev libgmock-dev librapidcheck-dev curl
  # the Python module (python/) for Debian's /usr/bin/python3, and its tests (CPU torch)
  python3-dev python3-pybind11 python3-torch python3-pytest
  # the ucx transport and its benchmark baseline; the emulated cluster (namespaces, tc) and its test
  libucx-dev ucx-utils iproute2 procps
)
if [ "${1:-}" = "--fuzz" ]; then
  packages+=(clang-14 libclang-rt-14-dev)
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--fuzz]" >&2
  exit 2
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "bootstrap: all ${#packages[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "bootstrap: missing packages: ${missing[*]}" >&2
  echo "bootstrap: run as root (or: sudo $0) to install them" >&2
  exit 1
fi

echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
