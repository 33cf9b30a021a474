# issue 46 (through device.sh, after diag.sh): the demo's adapter served as the demo serves it
# (`lorastack up` with the demo's serve.yaml: supervisor + gateway), scored through the gateway
# and directly, and its parity reference replayed through vLLM.
set -uo pipefail
L="python3 -m lorastack.cli"
D=/tmp/d
A=$($L store show date-iso/adapter | python3 -c "import json,sys; print(json.load(sys.stdin)['ref'])" 2>/dev/null || echo date-iso/adapter:1)
printf 'model: smollm2-135m-instruct\nserved_model_name: smollm2\nadapters: [%s]\nmax_model_len: 2048\nmax_num_seqs: 8\nkv_cache_gib: 1\nmax_lora_rank: 16\nmax_loras: 2\n%s' "$A" "${EXTRA:-}" > $D/serve.yaml
cat $D/serve.yaml
t=$(date +%s); $L up --serve-config $D/serve.yaml > $D/up.log 2>&1; echo "up rc $? after $(( $(date +%s) - t )) s"; tail -5 $D/up.log
curl -s localhost:8001/status | python3 -c "import json,sys; s=json.load(sys.stdin); print(s['state'], s.get('parity')); print(s['vllm'])" 
lora=$(curl -s localhost:8080/v1/models | python3 -c "import json,sys; print([m['id'] for m in json.load(sys.stdin)['data'] if m.get('parent')][-1])")
echo "lora: $lora"
grep -E "starting vLLM" $HOME/.lorastack/serve/*.log $LORASTACK_HOME/serve/*.log 2>/dev/null | tail -1 | cut -c1-600
for i in 1 2; do
  $L eval --base-url http://127.0.0.1:8080 --test date-iso/test --base-model smollm2 --lora-model $lora \
    --system-prompt "Convert the date to ISO 8601 (YYYY-MM-DD). Answer with the date only." \
    --few-shot "the fourth of July, 1999 => 1999-07-04" --few-shot "March 3rd 2021 => 2021-03-03" \
    --max-tokens 24 --no-publish --out $D/ev-gw-$i > $D/ev-gw.log 2>&1; echo "gateway eval $i: $(grep -m1 -i '^ *exact' $D/ev-gw.log)"
done
python3 bench/parity/vllm_exact.py --url http://127.0.0.1:8080 --test $D/test/test.jsonl --model $lora --label "gateway" | tee -a $OUT/stack.jsonl
python3 bench/parity/vllm_exact.py --url http://127.0.0.1:8000 --test $D/test/test.jsonl --model $lora --label "vllm direct" | tee -a $OUT/stack.jsonl
python3 bench/parity/check_served.py --url http://127.0.0.1:8000 --dtype bfloat16 --label "parity stack" $lora=$D/gpu-bf16/parity-reference.json | tee -a $OUT/stack.jsonl
cp $D/ev-gw-1/samples.jsonl $OUT/ev-samples.jsonl 2>/dev/null
$L down >/dev/null 2>&1
cp $LORASTACK_HOME/serve/vllm.log $OUT/stack-vllm.log 2>/dev/null
