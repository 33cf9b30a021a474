#!/usr/bin/env bash
# Both tools at once on the same server, each at CONCURRENCY, so both measure under the
# same (shared, busy) machine conditions; the server sees 2 x CONCURRENCY in flight.
# `vllm bench serve` starts first; lorastack starts when vllm's main run has begun.
# Usage: [PORT=8311] [OUT=DIR] bench/loadtest_vllm_cpu/compare_simultaneous.sh C N TAG
set -euo pipefail
C=$1; N=$2; TAG=$3
HERE=bench/loadtest_vllm_cpu
RESULTS=bench/results/loadtest-vllm-cpu
PORT=${PORT:-8311}
OUT=${OUT:-$RESULTS/simultaneous}
MODEL_DIR=${MODEL_DIR:-.cache/test-home/models/smollm2-b179c9523d0e}
IN=128; OUTLEN=64
mkdir -p "$OUT"
LOG="$OUT/vllm-bench-c$C-$TAG.log"
echo "== start $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python $HERE/vllm_bench_serve.py --backend openai-chat \
  --base-url http://127.0.0.1:$PORT --endpoint /v1/chat/completions \
  --model "$MODEL_DIR" --served-model-name smollm2 --tokenizer "$MODEL_DIR" \
  --dataset-name random --random-input-len $IN --random-output-len $OUTLEN --ignore-eos \
  --num-prompts "$N" --max-concurrency "$C" --request-rate inf --temperature 0 \
  --seed "$((C * 100 + 7))" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --save-result --save-detailed --result-dir "$OUT" --result-filename "vllm-bench-c$C-$TAG.json" \
  --disable-tqdm > "$LOG" 2>&1 &
VLLM=$!
for _ in $(seq 600); do grep -q "Starting main benchmark run" "$LOG" && break; sleep 0.5; done
echo "== vllm main run began $(date -u +%T); starting lorastack"
.venv/bin/lorastack loadtest --base-url http://127.0.0.1:$PORT --model smollm2 \
  --concurrency "$C" --requests "$N" --warmup 0 --input-len $IN --output-len $OUTLEN \
  --tokenizer "$MODEL_DIR" --seed "$((C * 100))" --out "$OUT/lorastack-c$C-$TAG"
wait $VLLM
grep -E "Benchmark duration|Median (TTFT|TPOT|ITL|E2EL)" "$LOG"
echo "== done $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
