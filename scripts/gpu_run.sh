#!/usr/bin/env bash
# Runs on the device machine from the bundle scripts/gpu_bundle.sh made (as
# .gpu/run.sh), most telling first, each step time-boxed so one hang cannot
# cost the rest: the attention kernels against a float64 reference,
# cuda_engine_bench on the llama-8b shape followed by the PyTorch peer (with
# pdserve ÷ peer per row), the gpu-labelled tests, then compute-sanitizer
# memcheck over the CUDA engine tests (eager and graphs) and racecheck over
# the attention kernels. Logs land in $OUT.
set -uo pipefail
cd "$(dirname "$0")"
# bin/, lib/ and glibc/ travel packed (gpu_bundle.sh).
if [ -f payload.tar.xz ] && [ ! -d bin ]; then tar xJf payload.tar.xz; fi
OUT="${OUT:-/tmp/pdserve-gpu-out}"
mkdir -p "$OUT"
START=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - START )) s: $*"; }
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
# The family checkpoints gpu_bundle.sh generated (family_reference.h).
export PDSERVE_FAMILIES_DIR="$PWD/families"

# Binaries built on Debian 12 (glibc 2.36); on an older glibc, run them
# through the carried loader and libc.
launch=()
if ! bin/comm_nccl_test --gtest_list_tests >/dev/null 2>"$OUT/launch.err"; then
  echo "direct start failed ($(head -c 200 "$OUT/launch.err")); using the carried glibc"
  launch=("$PWD/glibc/ld-linux-x86-64.so.2" --library-path "$PWD/glibc:$LD_LIBRARY_PATH")
fi

status=0
# gtest output filtered to what a person reads first; the whole log is kept.
run_test() {  # seconds binary [args...]
  local seconds=$1 t=$2
  shift 2
  stamp "$t $*"
  timeout "$seconds" "${launch[@]}" bin/"$t" "$@" 2>&1 | tee -a "$OUT/tests.log" |
    grep -E '^\[ (cuda|attention)|^\[  (PASSED|FAILED|SKIPPED)|Failure|flip|rror|Expected|Which is|actual' |
    head -80 || true
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "$t exited $rc"; status=1; }
}

# cuBLAS is loaded with dlopen (engine_cuda/cublas_loader.h): found here
# through LD_LIBRARY_PATH's CUDA folders, before any engine needs it.
run_test 20 engine_cublas_loader_test
run_test 60 engine_cuda_attention_test

stamp "cuda_engine_bench (llama-8b shape, dummy weights) + PyTorch peer"
peer=""
if python3 -c 'import torch' 2>/dev/null; then
  peer="python3 $PWD/torch_decode_peer.py $PWD/models/bench-configs/llama-8b.json --batches 1,32,128 --prefill 2048"
else
  echo "no PyTorch on the device: the bench runs without its peer"
fi
timeout 270 "${launch[@]}" bin/cuda_engine_bench \
  --config models/bench-configs/llama-8b.json --compare-fusion 0 \
  ${peer:+--peer-command "$peer"} \
  2>&1 | tee "$OUT/bench.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# The e2e test starts router/prefill_worker/decode_worker from bin/ (the
# tokenizer finds its sentencepiece shim next to them).
export PDSERVE_BIN_DIR="$PWD/bin"
run_test 180 engine_cuda_test
run_test 75 decode_cuda_test
run_test 60 prefill_cuda_test
run_test 90 e2e_cuda_cluster_test
run_test 30 comm_nccl_test

if [ ${#launch[@]} -eq 0 ] && command -v compute-sanitizer >/dev/null; then
  stamp "compute-sanitizer memcheck: attention kernels, every CUDA engine test (eager and graphs)"
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 \
    bin/engine_cuda_attention_test >"$OUT/memcheck_attention.log" 2>&1
  echo "memcheck attention exit $? ($(grep -c 'Invalid' "$OUT/memcheck_attention.log") invalid accesses)"
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 \
    bin/engine_cuda_test >"$OUT/memcheck_engine.log" 2>&1
  echo "memcheck engine exit $? ($(grep -c 'Invalid' "$OUT/memcheck_engine.log") invalid accesses)"
  grep -m5 -A6 'Invalid' "$OUT"/memcheck_*.log || true
  stamp "compute-sanitizer racecheck: attention kernels"
  timeout 90 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 3 \
    bin/engine_cuda_attention_test >"$OUT/racecheck.log" 2>&1
  echo "racecheck exit $? ($(grep -ci 'hazard' "$OUT/racecheck.log") hazard lines)"
  grep -m5 -i -B2 -A6 'hazard' "$OUT/racecheck.log" || true
fi
stamp "done"
exit $status
