# issue 46 (through device.sh): `lorastack demo --stop` on the GPU machine as a user runs it
# (a new LORASTACK_HOME), then the demo's merged model served alone (`lorastack up`, dtype
# auto) with its parity verdict, then, while the call's time allows, the demo's adapter
# again with vLLM's compiled CUDA graphs (the default outside the demo) in the dtype auto
# chooses, scored with the demo's own eval command.
set -uo pipefail
t0=$(date +%s)
L="python3 -m lorastack.cli"
D=$LORASTACK_HOME/demo
$L demo --stop 2>&1 | tee $OUT/demo-run.log | grep -vE "^step [0-9]+/|it/s\]|Loading weights"
echo "demo took $(( $(date +%s) - t0 )) s"
cp $D/eval/report.json $OUT/demo-eval.json 2>/dev/null
cp $LORASTACK_HOME/logs/inference.log $OUT/demo-inference.log 2>/dev/null
[ -n "${DEMO_ONLY:-}" ] && exit 0  # the demo alone (DEMO_ONLY=1)
status() { curl -s localhost:8001/status | python3 -c "import json,sys; s=json.load(sys.stdin); print(json.dumps({'state': s['state'], 'dtype': s['dtype'], 'parity': s['parity']}))"; }
# the merged model alone
printf 'model: date-iso/merged\nserved_model_name: merged\nmax_model_len: 2048\nmax_num_seqs: 8\nextra_vllm_args: ["--enforce-eager"]\n' > /tmp/merged.yaml
t=$(date +%s); $L up --serve-config /tmp/merged.yaml > /tmp/up-merged.log 2>&1; echo "merged up rc $? after $(( $(date +%s) - t )) s"
status | tee $OUT/merged-status.json
$L status | grep -iE "parity|served in|FAIL|  " | head -12
$L down >/dev/null 2>&1
# the adapter with CUDA graphs + torch.compile (vLLM's default), dtype auto
if [ $(( $(date +%s) - t0 )) -lt 380 ]; then
  sed '/extra_vllm_args/,+1d' $D/serve.yaml > /tmp/compiled.yaml
  t=$(date +%s); $L up --serve-config /tmp/compiled.yaml > /tmp/up-compiled.log 2>&1; echo "compiled up rc $? after $(( $(date +%s) - t )) s"
  status | tee $OUT/compiled-status.json
  lora=$(curl -s localhost:8080/v1/models | python3 -c "import json,sys; print([m['id'] for m in json.load(sys.stdin)['data'] if m.get('parent')][-1])")
  $L eval --base-url http://127.0.0.1:8080 --test date-iso/test --base-model smollm2 --lora-model $lora \
    --system-prompt "Convert the date to ISO 8601 (YYYY-MM-DD). Answer with the date only." \
    --few-shot "the fourth of July, 1999 => 1999-07-04" --few-shot "March 3rd 2021 => 2021-03-03" \
    --max-tokens 24 --no-publish --out /tmp/ev-compiled > /tmp/ev-compiled.log 2>&1
  echo "compiled eval: $(grep -m1 -E '^ *exact' /tmp/ev-compiled.log)"
  $L down >/dev/null 2>&1
fi
echo "all took $(( $(date +%s) - t0 )) s"
