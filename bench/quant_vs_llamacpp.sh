#!/usr/bin/env bash
# pdserve against llama.cpp on the same GGUF files, back to back in one run:
# 512-token prefill and batch-1 greedy decode tok/s on 2 threads, for f32,
# f16, Q8_0 and Q4_K_M files of a model shape (default llama-110m), written
# at bench time by build/bench/quant_bench (pseudo-random weights). llama.cpp
# comes from npm's node-llama-cpp (its prebuilt CPU binaries, which pick the
# best variant for this CPU at run time), installed into build/llamacpp.
#
#   [THREADS=2] bench/quant_vs_llamacpp.sh [CONFIG.json] [ROUNDS]
#
# Each round runs, per format, pdserve then llama.cpp (best of 3 each);
# rounds alternate the order of the two engines. Prints one line per run and
# a table of ratios (pdserve / llama.cpp, and pdserve format / pdserve f32).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${1:-../shared/models/bench-configs/llama-110m.json}"
ROUNDS="${2:-2}"
THREADS="${THREADS:-2}"
DIR=build/quant-bench
mkdir -p "$DIR"

[ -x build/bench/quant_bench ] || cmake --build build --target quant_bench
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true scripts/install_npm_packages.sh quant-bench \
  build/llamacpp node-llama-cpp@3.22.1 >/dev/null
export NODE_PATH="$PWD/build/llamacpp/node_modules"

FORMATS=(f32 f16 q8_0 q4_k_m)
missing=()
for f in "${FORMATS[@]}"; do [ -f "$DIR/bench-$f.gguf" ] || missing+=("$f"); done
if ((${#missing[@]})); then
  build/bench/quant_bench make --config "$CONFIG" --dir "$DIR" \
    --formats "$(IFS=,; echo "${missing[*]}")"
fi

RESULTS="$DIR/results.jsonl"
: >"$RESULTS"
echo "load: $(uptime)"
for ((round = 0; round < ROUNDS; ++round)); do
  for f in "${FORMATS[@]}"; do
    model="$DIR/bench-$f.gguf"
    run_pdserve() {
      build/bench/quant_bench run --model "$model" --threads $THREADS \
        --prompt 512 --decode 64 --repeats 3 2>/dev/null |
        sed "s/^{/{\"format\": \"$f\", \"round\": $round, /" | tee -a "$RESULTS"
    }
    run_llamacpp() {
      node bench/llamacpp_bench.mjs "$model" $THREADS 512 64 3 |
        sed "s/^{/{\"format\": \"$f\", \"round\": $round, /" | tee -a "$RESULTS"
    }
    if ((round % 2 == 0)); then run_pdserve; run_llamacpp; else run_llamacpp; run_pdserve; fi
  done
done
echo "load: $(uptime)"

# Best of the rounds per engine and format, then the ratios.
/usr/bin/python3 - "$RESULTS" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r["engine"], r["format"])
    b = best.setdefault(key, {"prefill": 0, "decode": 0})
    b["prefill"] = max(b["prefill"], r["prefill_tok_s"])
    b["decode"] = max(b["decode"], r["decode_tok_s"])
f32 = best.get(("pdserve", "f32"))
print("| format | pdserve decode | llama.cpp decode | ratio | pdserve prefill | llama.cpp prefill | ratio | pdserve decode / pdserve f32 |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for fmt in ["f32", "f16", "q8_0", "q4_k_m"]:
    p, l = best.get(("pdserve", fmt)), best.get(("llama.cpp", fmt))
    if not p or not l:
        continue
    print(f"| {fmt} | {p['decode']:.1f} | {l['decode']:.1f} | {p['decode']/l['decode']:.2f}x "
          f"| {p['prefill']:.1f} | {l['prefill']:.1f} | {p['prefill']/l['prefill']:.2f}x "
          f"| {p['decode']/f32['decode']:.2f}x |")
PY
