# Shared by compare.sh and compare_simultaneous.sh (sourced, from the repo root): the
# server, the model and the load shape both tools use, and one command line per tool.
HERE=bench/loadtest
RESULTS=bench/loadtest/results/$(date +%F)-$(git rev-parse --short HEAD)
PORT=${PORT:-8311}
MODEL_DIR=${MODEL_DIR:-.cache/test-home/models/smollm2-b179c9523d0e}
IN=128; OUTLEN=64

load() { cut -d' ' -f1-3 /proc/loadavg; }

# vllm_bench C N OUT TAG: `vllm bench serve`, chat endpoint, streaming, random prompts
vllm_bench() {
  .venv/bin/python $HERE/vllm_bench_serve.py --backend openai-chat \
    --base-url http://127.0.0.1:$PORT --endpoint /v1/chat/completions \
    --model "$MODEL_DIR" --served-model-name smollm2 --tokenizer "$MODEL_DIR" \
    --dataset-name random --random-input-len $IN --random-output-len $OUTLEN --ignore-eos \
    --num-prompts "$2" --max-concurrency "$1" --request-rate inf --temperature 0 \
    --seed "$(($1 * 100 + 7))" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --save-detailed --result-dir "$3" --result-filename "vllm-bench-c$1-$4.json" \
    --disable-tqdm
}

# lorastack_loadtest C N OUT TAG WARMUP: the same load through `lorastack loadtest`
lorastack_loadtest() {
  .venv/bin/lorastack loadtest --base-url http://127.0.0.1:$PORT --model smollm2 \
    --concurrency "$1" --requests "$2" --warmup "$5" --input-len $IN --output-len $OUTLEN \
    --tokenizer "$MODEL_DIR" --seed "$(($1 * 100))" --out "$3/lorastack-c$1-$4"
}
