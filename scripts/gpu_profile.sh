#!/usr/bin/env bash
# Per-kernel GPU time of one decode step (and optionally one prefill) of
# cuda_engine_bench on the llama-8b shape, with Nsight Compute: kernel
# durations summed by kernel name, largest first. Runs on the device from the
# bundle (.gpu/profile.sh), after run.sh has unpacked it or by itself.
#
#   bash .gpu/profile.sh 1,32,128 [prefill]  # batches, one ncu pass each;
#                                            # then one 2048-token prefill
set -uo pipefail
cd "$(dirname "$0")"
if [ -f payload.tar.xz ] && [ ! -d bin ]; then tar xJf payload.tar.xz; fi
OUT="${OUT:-/tmp/pdserve-gpu-out}"
mkdir -p "$OUT"
cuda_dirs=""
for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  path=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
  [ -z "$path" ] && path=$(find /usr/local/cuda* /usr/lib /opt /usr/local/lib -name "$lib" 2>/dev/null | head -1)
  [ -n "$path" ] && cuda_dirs="$cuda_dirs:$(dirname "$path")"
done
export LD_LIBRARY_PATH="$PWD/lib$cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
summarize() {  # csv title
  python3 - "$1" "$2" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
cols = rows[head]
name_i, value_i = cols.index("Kernel Name"), cols.index("Metric Value")
unit_i = cols.index("Metric Unit")
total = collections.defaultdict(float); count = collections.Counter()
for r in rows[head + 1:]:
    if len(r) <= value_i: continue
    v = float(r[value_i].replace(",", ""))
    unit = r[unit_i]
    us = {"ns": v / 1e3, "nsecond": v / 1e3, "us": v, "usecond": v,
          "ms": v * 1e3, "msecond": v * 1e3}.get(unit, v / 1e3)
    n = r[name_i][:70]
    total[n] += us; count[n] += 1
all_us = sum(total.values())
print(f"## {sys.argv[2]}: {sum(count.values())} kernels, {all_us / 1000:.3f} ms")
for n, us in sorted(total.items(), key=lambda x: -x[1])[:14]:
    print(f"{us:10.1f} us {count[n]:5d}x  {us / count[n]:8.1f} us each  {n}")
PY
}
for batch in ${1//,/ }; do
  # One decode step of 32 layers is ~12 kernels per layer plus the head.
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum \
    --launch-count 420 --kill yes --csv \
    bin/cuda_engine_bench --config models/bench-configs/llama-8b.json \
    --batches "$batch" --steps 1 --skip-reference 1 --compare-legacy 0 \
    --compare-fusion 0 >"$OUT/ncu_b$batch.csv" 2>"$OUT/ncu_b$batch.err"
  summarize "$OUT/ncu_b$batch.csv" "decode step batch $batch" || tail -5 "$OUT/ncu_b$batch.err"
done
if [ "${2:-}" = prefill ]; then
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum \
    --launch-count 500 --kill yes --csv \
    bin/cuda_engine_bench --config models/bench-configs/llama-8b.json \
    --decode 0 --skip-reference 1 --compare-legacy 0 --compare-fusion 0 \
    >"$OUT/ncu_prefill.csv" 2>"$OUT/ncu_prefill.err"
  summarize "$OUT/ncu_prefill.csv" "prefill 1 x 2048" || tail -5 "$OUT/ncu_prefill.err"
fi
