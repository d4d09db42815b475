#!/usr/bin/env bash
# Raw put bandwidth of pdserve's transport beside `ucx_perftest -t ucp_put_bw`
# at the same sizes on this machine, then the llama-110m KV transfer.
# Usage: bench/transport_bench.sh [build-dir]   (default: build)
# Not a test: numbers depend on the machine; see docs/PERFORMANCE.md.
set -euo pipefail
BUILD=${1:-build}
BENCH="$BUILD/bench/transport_bench"
[[ -x "$BENCH" ]] || { echo "build transport_bench first ($BENCH)" >&2; exit 1; }
command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing (apt install ucx-utils)" >&2; exit 1; }
export PDSERVE_LOG_LEVEL=warning

# ucx_perftest reports MiB/s; everything below is printed in MB/s (1e6 B/s).
perftest() {  # size -> MB/s
  local size=$1 port=$((20000 + RANDOM % 20000))
  local iters=$(( (1 << 30) / size )); (( iters < 100 )) && iters=100
  timeout 120 ucx_perftest -t ucp_put_bw -s "$size" -n "$iters" -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  local line
  line=$(timeout 120 ucx_perftest 127.0.0.1 -t ucp_put_bw -s "$size" -n "$iters" -p "$port" 2>/dev/null | grep Final: || true)
  wait "$server" 2>/dev/null || true
  awk -v l="$line" 'BEGIN { split(l, f, " "); printf "%.0f", f[6] * 1.048576 }'
}

echo "== pdserve transport_bench (peer error handling off: shared memory, like ucx_perftest's default)"
ours_off=$("$BENCH" --no-peer-errors)
echo "== pdserve transport_bench (peer error handling on: UCX 1.13 restricts to tcp)"
ours_on=$("$BENCH")
echo "== pdserve transport_bench, sink in ordinary (non-UCX) memory, peer errors off"
ours_user=$(BENCH_USER_POOL=1 "$BENCH" --no-peer-errors)

printf "\n%-10s %14s %14s %14s %14s %8s\n" size perftest_MB/s ours_hot_MB/s ours_cold_MB/s ours_tcp_MB/s hot/pt
for size in 65536 262144 1048576 4194304 16777216; do
  pt=$(perftest "$size")
  read -r _ hot cold < <(grep "^$size " <<<"$ours_off")
  read -r _ tcp _ < <(grep "^$size " <<<"$ours_on")
  ratio=$(awk -v a="$hot" -v b="$pt" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }')
  printf "%-10s %14s %14s %14s %14s %8s\n" "$size" "$pt" "$hot" "$cold" "$tcp" "$ratio"
done
echo
grep kv_transfer <<<"$ours_off"
grep kv_transfer <<<"$ours_on"
grep kv_transfer <<<"$ours_user"
echo "user-memory raw put (peer errors off):"
grep -A5 raw_put <<<"$ours_user" | tail -5
