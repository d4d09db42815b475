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
# rounds alternate the order of the two engines. The quantized formats also
# run pdserve with --quantized-matmul exact (int8 activations off). Prints
# one line per run and tables of ratios (pdserve / llama.cpp, and pdserve
# format / pdserve f32), of the best and of the median round.
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
      # The quantized formats again with int8 activations off (the exact
      # f32 products): the feature's own effect, side by side.
      if [[ $f == q* ]]; then
        build/bench/quant_bench run --model "$model" --threads $THREADS \
          --prompt 512 --decode 64 --repeats 3 --quantized-matmul exact \
          2>/dev/null | sed -e "s/^{/{\"format\": \"$f\", \"round\": $round, /" \
          -e 's/"engine": "pdserve"/"engine": "pdserve-exact"/' | tee -a "$RESULTS"
      fi
    }
    run_llamacpp() {
      node bench/llamacpp_bench.mjs "$model" $THREADS 512 64 3 |
        sed "s/^{/{\"format\": \"$f\", \"round\": $round, /" | tee -a "$RESULTS"
    }
    if ((round % 2 == 0)); then run_pdserve; run_llamacpp; else run_llamacpp; run_pdserve; fi
  done
done
echo "load: $(uptime)"

# Best and median of the rounds per engine and format, then the ratios (of
# the bests; the VM's speed moves between rounds, so both are printed).
/usr/bin/python3 - "$RESULTS" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs.setdefault((r["engine"], r["format"]), []).append(r)
def stat(engine, fmt, key, how):
    values = [r[key] for r in runs.get((engine, fmt), [])]
    if not values:
        return None
    return max(values) if how == "best" else statistics.median(values)
for how in ["best", "median"]:
    print(f"\n{how} of {len(runs.get(('pdserve', 'f32'), []))} rounds:")
    print("| format | pdserve decode | llama.cpp decode | ratio | pdserve prefill | llama.cpp prefill | ratio | pdserve decode / pdserve f32 | int8 off: decode, prefill |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    f32 = stat("pdserve", "f32", "decode_tok_s", how)
    for fmt in ["f32", "f16", "q8_0", "q4_k_m"]:
        pd, ld = stat("pdserve", fmt, "decode_tok_s", how), stat("llama.cpp", fmt, "decode_tok_s", how)
        pp, lp = stat("pdserve", fmt, "prefill_tok_s", how), stat("llama.cpp", fmt, "prefill_tok_s", how)
        if pd is None or ld is None:
            continue
        ed, ep = stat("pdserve-exact", fmt, "decode_tok_s", how), stat("pdserve-exact", fmt, "prefill_tok_s", how)
        exact = f"{ed:.1f}, {ep:.1f}" if ed is not None else "—"
        print(f"| {fmt} | {pd:.1f} | {ld:.1f} | {pd/ld:.2f}x | {pp:.1f} | {lp:.1f} | {pp/lp:.2f}x "
              f"| {pd/f32:.2f}x | {exact} |")
PY
