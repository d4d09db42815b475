#!/usr/bin/env bash
# The test command (README, .ci/run): installs and builds if needed, checks
# formatting, runs every test through CTest, then runs the bad-input tests
# again in a Debug + AddressSanitizer/UBSan build. Where the machine image
# carries CUDA and NCCL the release tree builds the CUDA backend too
# (CMakeLists.txt), so "every test" includes the `gpu` tests, which skip
# cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/check_format.sh

JOBS="${PDSERVE_JOBS:-$(nproc)}"
echo "== all tests (release build)"
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 900

echo "== bad-input tests under AddressSanitizer + UBSan"
# -g1: line tables and function names, all a sanitizer report prints; full
# debug info (-g) only makes this tree slower to compile and link.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPDSERVE_SANITIZE=ON \
  -DPDSERVE_CUDA=OFF -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DCMAKE_C_FLAGS_DEBUG=-g1 >/dev/null
cmake --build build-asan -j "$JOBS" --target badinput_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" -L badinput --timeout 900

