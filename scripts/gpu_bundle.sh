#!/usr/bin/env bash
# Prepares one device run of the CUDA checks: builds the CUDA code, then
# gathers into .gpu/ (ignored by git, never committed) the gpu test binaries
# and cuda_engine_bench, the non-CUDA shared libraries they load (the device
# image has CUDA, cuBLAS and NCCL but not Debian's abseil, OpenBLAS or
# GoogleTest), glibc for a fallback loader, the models the tests read (and
# the model-family checkpoints with their references), and the PyTorch peer the bench runs after itself (the device cannot see
# ../shared). Then, with the device tool:
#
#   run  command: "bash .gpu/run.sh"   carry: [".gpu"]   timeout_s: 540
#
# .gpu/run.sh prints the GPU tests' results and the benchmark's table, and
# leaves tests.log and bench.md in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="${PDSERVE_MODELS_DIR:-../shared/models}"
PEERS="${PDSERVE_PEERS_DIR:-../shared/peers}"

# The release tree, with the CUDA backend (CMakeLists.txt turns it on where
# nvcc and NCCL are; -D here for a tree first configured without them).
BUILD="${PDSERVE_BUILD_DIR:-build}"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSERVE_CUDA=ON >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target gpu_tests cuda_engine_bench \
  pdserve_sentencepiece_shim

grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib .gpu/glibc .gpu/models
BINARIES=("$BUILD"/tests/engine/engine_cuda_attention_test
          "$BUILD"/tests/engine/engine_cublas_loader_test
          "$BUILD"/tests/engine/engine_cuda_test "$BUILD"/tests/comm/comm_nccl_test
          "$BUILD"/tests/decode/decode_cuda_test "$BUILD"/tests/prefill/prefill_cuda_test
          "$BUILD"/tests/e2e/e2e_cuda_cluster_test
          "$BUILD"/router/router "$BUILD"/prefill_worker/prefill_worker
          "$BUILD"/decode_worker/decode_worker
          "$BUILD"/libpdserve_sentencepiece_shim.so
          "$BUILD"/bench/cuda_engine_bench)
for b in "${BINARIES[@]}"; do
  cp "$b" .gpu/bin/
  strip .gpu/bin/"$(basename "$b")"
done
# Every library ldd resolves, except the CUDA ones the device brings (cuBLAS
# and NCCL are hundreds of MB; the runtime is small and travels).
for lib in $(ldd "${BINARIES[@]}" | awk '/=> \//{print $3}' | sort -u); do
  name=$(basename "$lib")
  case "$name" in
    libcuda.so*|libcublas*|libnccl*) ;;
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*) cp -L "$lib" .gpu/glibc/ ;;
    *) cp -L "$lib" .gpu/lib/ ;;
  esac
done
cp -L /lib64/ld-linux-x86-64.so.2 .gpu/glibc/
cp -r "$MODELS/stories260K" "$MODELS/bench-configs" .gpu/models/
# The model-family checkpoints and their float64 references, generated here
# (the device may have no numpy) with the arguments the tests use
# (family_reference.h, kFamilyMaxNew); run.sh points PDSERVE_FAMILIES_DIR
# at them (~5 MB).
REFERENCE=tests/model/reference
/usr/bin/python3 "$REFERENCE/make_tiny_checkpoints.py" .gpu/families
for family in $(/usr/bin/python3 -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))))' \
                  .gpu/families/families.json); do
  /usr/bin/python3 "$REFERENCE/hf_reference.py" ".gpu/families/$family" --max-new 16 \
    >".gpu/families/$family/reference.json"
done
cp scripts/gpu_run.sh .gpu/run.sh
cp scripts/gpu_profile.sh .gpu/profile.sh
cp "$PEERS/torch_decode_peer.py" .gpu/
# What travels to the device is capped (64 MiB); OpenBLAS alone is 36 MB, so
# binaries and libraries go as one xz archive (~15 MB) that run.sh unpacks.
XZ_OPT=-T0 tar cJf .gpu/payload.tar.xz -C .gpu bin lib glibc
rm -rf .gpu/bin .gpu/lib .gpu/glibc
du -sh .gpu
