#!/usr/bin/env bash
# Side-by-side: `lorastack loadtest` then `vllm bench serve`, same endpoint, same load shape.
# Usage (from the repo root; a server from serve_smollm2.py or fake_server.py on $PORT):
#   [PORT=8311] [OUT=DIR] bench/loadtest_vllm_cpu/compare.sh CONCURRENCY REQUESTS TAG
# Same for both: chat endpoint, streaming, 128 random input tokens (SmolLM2 tokenizer),
# 64 output tokens with ignore_eos, temperature 0, at most CONCURRENCY in flight, no rate limit.
# lorastack does not scrape /metrics here, so the server sees exactly the same traffic.
set -euo pipefail
C=$1; N=$2; TAG=$3
HERE=bench/loadtest_vllm_cpu
RESULTS=bench/results/loadtest-vllm-cpu
PORT=${PORT:-8311}
OUT=${OUT:-$RESULTS}
MODEL_DIR=${MODEL_DIR:-.cache/test-home/models/smollm2-b179c9523d0e}
IN=128; OUTLEN=64
mkdir -p "$OUT"
echo "== lorastack loadtest c=$C ($TAG) $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/lorastack loadtest --base-url http://127.0.0.1:$PORT --model smollm2 \
  --concurrency "$C" --requests "$N" --warmup 1 --input-len $IN --output-len $OUTLEN \
  --tokenizer "$MODEL_DIR" --seed "$((C * 100))" --out "$OUT/lorastack-c$C-$TAG"
echo "== vllm bench serve c=$C ($TAG) $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python $HERE/vllm_bench_serve.py --backend openai-chat \
  --base-url http://127.0.0.1:$PORT --endpoint /v1/chat/completions \
  --model "$MODEL_DIR" --served-model-name smollm2 --tokenizer "$MODEL_DIR" \
  --dataset-name random --random-input-len $IN --random-output-len $OUTLEN --ignore-eos \
  --num-prompts "$N" --max-concurrency "$C" --request-rate inf --temperature 0 \
  --seed "$((C * 100 + 7))" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --save-result --save-detailed --result-dir "$OUT" --result-filename "vllm-bench-c$C-$TAG.json" \
  --disable-tqdm 2>&1 | grep -v -e nanobind -e "leaked" -e "skipped remainder" -e "^Namespace("
echo "== done $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
