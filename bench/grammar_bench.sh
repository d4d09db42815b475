#!/usr/bin/env bash
# Grammar mask cost per token next to a batch-1 decode step on the llama-110m
# shape, measured in the same run (docs/PERFORMANCE.md, Grammar).
#
#   bench/grammar_bench.sh [BUILD_DIR] [grammar_bench flags...]
# Runs engine_bench for the decode step (batch 1, context 128), then
# grammar_bench with --decode-step-ms set to it, so every ratio is against a
# step measured minutes apart on the same machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
shift || true
step_line=$("$BUILD/bench/engine_bench" --batches 1 --prompt 64 --steps 32 \
  --projection-batches 1 | grep '^| decode batch 1 ')
echo "$step_line"
step_ms=$(echo "$step_line" | sed -E 's/.* ([0-9.]+) ms\/step.*/\1/')
echo "decode step: $step_ms ms"
exec "$BUILD/bench/grammar_bench" --decode-step-ms "$step_ms" "$@"
