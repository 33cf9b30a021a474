#!/usr/bin/env bash
# Both tools at once on the same server, each at CONCURRENCY, so both measure under the
# same (shared, busy) machine conditions; the server sees 2 x CONCURRENCY in flight.
# `vllm bench serve` starts first; lorastack starts when vllm's main run has begun.
# Usage: [PORT=8311] [OUT=DIR] bench/loadtest/compare_simultaneous.sh C N TAG
set -euo pipefail
C=$1; N=$2; TAG=$3
source bench/loadtest/common.sh
OUT=${OUT:-$RESULTS/simultaneous}
mkdir -p "$OUT"
LOG="$OUT/vllm-bench-c$C-$TAG.log"
echo "== start $(date -u +%T) load: $(load)"
vllm_bench "$C" "$N" "$OUT" "$TAG" > "$LOG" 2>&1 &
VLLM=$!
for _ in $(seq 600); do grep -q "Starting main benchmark run" "$LOG" && break; sleep 0.5; done
echo "== vllm main run began $(date -u +%T); starting lorastack"
lorastack_loadtest "$C" "$N" "$OUT" "$TAG" 0
wait $VLLM
grep -E "Benchmark duration|Median (TTFT|TPOT|ITL|E2EL)" "$LOG"
echo "== done $(date -u +%T) load: $(load)"
