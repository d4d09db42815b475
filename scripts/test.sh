#!/usr/bin/env bash
# The test command (README, .ci/run): installs and builds if needed, checks
# formatting, runs every test through CTest, then runs the bad-input tests
# again in a Debug + AddressSanitizer/UBSan build, then (where the machine
# image carries CUDA) builds the CUDA/NCCL code and runs the `gpu` tests,
# which skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/check_format.sh

JOBS="${PDSERVE_JOBS:-$(nproc)}"
echo "== all tests (release build)"
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 900

echo "== bad-input tests under AddressSanitizer + UBSan"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPDSERVE_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$JOBS" --target badinput_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" -L badinput --timeout 900

if [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA build (-DPDSERVE_CUDA=ON) and gpu-labelled tests"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSERVE_CUDA=ON >/dev/null
  cmake --build build-cuda -j "$JOBS" --target gpu_tests
  ctest --test-dir build-cuda --output-on-failure -j "$JOBS" -L gpu --timeout 900
fi
