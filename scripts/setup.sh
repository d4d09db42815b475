#!/usr/bin/env bash
# Installs every Debian package pdserve needs (idempotent: apt-get runs only
# when something is missing, and updates its lists first), then configures and
# builds the release tree in ./build.
#
#   scripts/setup.sh            # install + build
#   PDSERVE_BUILD_DIR=... PDSERVE_CMAKE_ARGS="..." scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config clang-format
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libucx-dev ucx-utils prometheus-cpp-dev prometheus
  libsentencepiece-dev libpcre2-dev libicu-dev libopenblas-dev nlohmann-json3-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-numpy
  libc-ares-dev dnsmasq-base
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log=$(mktemp /tmp/pdserve-apt.XXXXXX.log)
  if ! { $SUDO apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
           "${missing[@]}"; } >"$log" 2>&1; then
    tail -n 30 "$log"
    echo "setup: apt-get failed (full log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
fi

BUILD_DIR="${PDSERVE_BUILD_DIR:-build}"
JOBS="${PDSERVE_JOBS:-$(nproc)}"
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${PDSERVE_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "setup: built into $BUILD_DIR"
