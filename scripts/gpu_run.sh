#!/usr/bin/env bash
# Runs on the device machine from the bundle scripts/gpu_bundle.sh made (as
# .gpu/run.sh): the gpu-labelled tests, compute-sanitizer over the CUDA
# engine's tests, and cuda_engine_bench on the llama-8b shape.
set -uo pipefail
cd "$(dirname "$0")"
# bin/, lib/ and glibc/ travel packed (gpu_bundle.sh).
if [ -f payload.tar.xz ] && [ ! -d bin ]; then tar xJf payload.tar.xz; fi
OUT="${OUT:-/tmp/pdserve-gpu-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# CUDA libraries of the device image (system CUDA, or pip's nvidia wheels).
cuda_dirs=""
for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  path=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
  if [ -z "$path" ]; then
    path=$(find /usr/local/cuda* /usr/lib /opt /usr/local/lib \
             -name "$lib" 2>/dev/null | head -1)
  fi
  [ -n "$path" ] && cuda_dirs="$cuda_dirs:$(dirname "$path")"
  [ -z "$path" ] && echo "warning: $lib not found on the device"
done
export LD_LIBRARY_PATH="$PWD/lib$cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PDSERVE_MODELS_DIR="$PWD/models"

# Binaries built on Debian 12 (glibc 2.36); on an older glibc, run them
# through the carried loader and libc.
launch=()
if ! bin/comm_nccl_test --gtest_list_tests >/dev/null 2>"$OUT/launch.err"; then
  echo "direct start failed ($(head -c 200 "$OUT/launch.err")); using the carried glibc"
  launch=("$PWD/glibc/ld-linux-x86-64.so.2" --library-path "$PWD/glibc:$LD_LIBRARY_PATH")
fi

status=0
echo "== gpu tests"
# The e2e test starts router/prefill_worker/decode_worker from bin/ (the
# tokenizer finds its sentencepiece shim next to them).
export PDSERVE_BIN_DIR="$PWD/bin"
for t in comm_nccl_test engine_cuda_test decode_cuda_test prefill_cuda_test \
         e2e_cuda_cluster_test; do
  "${launch[@]}" bin/$t 2>&1 | tee -a "$OUT/tests.log" |
    grep -E '^\[ cuda|^\[  (PASSED|FAILED|SKIPPED)|Failure|flip|rror' || true
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

if [ ${#launch[@]} -eq 0 ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck (CUDA engine tests, eager and graphs)"
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 \
    bin/engine_cuda_test --gtest_filter='*PromptLogits*:*GraphReplay*:*BadInput*' \
    >"$OUT/memcheck.log" 2>&1
  echo "memcheck exit $? ($(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses)"
  grep -m5 -A6 'Invalid' "$OUT/memcheck.log" || true
fi

echo "== cuda_engine_bench (llama-8b shape, dummy weights)"
timeout 360 "${launch[@]}" bin/cuda_engine_bench \
  --config models/bench-configs/llama-8b.json 2>&1 | tee "$OUT/bench.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
