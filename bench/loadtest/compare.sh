#!/usr/bin/env bash
# Side-by-side: `lorastack loadtest` then `vllm bench serve`, same endpoint, same load shape.
# Usage (from the repo root; a server from serve_smollm2.py or `python -m lorastack_testing.fake_vllm` on $PORT):
#   [PORT=8311] [OUT=DIR] bench/loadtest/compare.sh CONCURRENCY REQUESTS TAG
# Same for both: chat endpoint, streaming, 128 random input tokens (SmolLM2 tokenizer),
# 64 output tokens with ignore_eos, temperature 0, at most CONCURRENCY in flight, no rate limit.
# lorastack does not scrape /metrics here, so the server sees exactly the same traffic.
set -euo pipefail
C=$1; N=$2; TAG=$3
source bench/loadtest/common.sh
OUT=${OUT:-$RESULTS}
mkdir -p "$OUT"
echo "== lorastack loadtest c=$C ($TAG) $(date -u +%T) load: $(load)"
lorastack_loadtest "$C" "$N" "$OUT" "$TAG" 1
echo "== vllm bench serve c=$C ($TAG) $(date -u +%T) load: $(load)"
vllm_bench "$C" "$N" "$OUT" "$TAG" 2>&1 \
  | grep -v -e nanobind -e "leaked" -e "skipped remainder" -e "^Namespace("
echo "== done $(date -u +%T) load: $(load)"
