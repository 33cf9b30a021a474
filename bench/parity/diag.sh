# issue 46's diagnosis (run through device.sh): the demo trained on the GPU in bf16 (as the
# trainer does) and in fp32, and the CPU demo's adapter (carried), each scored on the frozen
# test split with HF + PEFT greedy in fp32 and bf16, and with CUDA vLLM (eager) in fp32 and bf16.
set -uo pipefail
L="python3 -m lorastack.cli"
D=/tmp/d; mkdir -p $D
CFG=services/trainer/src/trainer/configs/demo.yaml
t=$(date +%s); $L model import-default >/dev/null || exit 1; echo "import $(( $(date +%s) - t )) s"
$L data make-demo $D/demo-dates.jsonl >/dev/null || exit 1
t=$(date +%s); $L train $CFG dataset.path=$D/demo-dates.jsonl > $D/train-bf16.log 2>&1 || { tail -30 $D/train-bf16.log;
  $L train $CFG dataset.path=$D/demo-dates.jsonl parity_probes=0 > $D/train-bf16.log 2>&1 || exit 1; }
grep -i "parity" $D/train-bf16.log
echo "train bf16 $(( $(date +%s) - t )) s"; grep -E "step 20/|val" $D/train-bf16.log | tail -3
t=$(date +%s); python3 bench/parity/train_fp32.py $CFG dataset.path=$D/demo-dates.jsonl output=date-iso-fp32 parity_probes=0 > $D/train-fp32.log 2>&1 || { tail -30 $D/train-fp32.log; }
echo "train fp32 $(( $(date +%s) - t )) s"; grep -E "step 20/|val" $D/train-fp32.log | tail -3
$L store get smollm2-135m-instruct $D/base >/dev/null && $L store get date-iso/adapter $D/gpu-bf16 >/dev/null \
  && $L store get date-iso/test $D/test >/dev/null || exit 1
$L store get date-iso-fp32/adapter $D/gpu-fp32 >/dev/null
cp $D/gpu-bf16/parity-reference.json $OUT/gpu-bf16-reference.json 2>/dev/null
cp -r .dev-demo/part4/cpu-adapter $D/cpu
cmp $D/test/test.jsonl .dev-demo/part4/cpu-test.jsonl && echo "test split identical to the CPU run's"
for a in gpu-bf16 gpu-fp32 cpu; do
  [ -d $D/$a ] || continue
  for dt in float32 bfloat16; do
    python3 bench/parity/hf_exact.py --base $D/base --adapter $D/$a --test $D/test/test.jsonl --dtype $dt --device cuda --label "hf $a" | tee -a $OUT/diag.jsonl
  done
done
mods=""; for a in gpu-bf16 gpu-fp32 cpu; do [ -d $D/$a ] && mods="$mods $a=$D/$a"; done
for dt in float32 bfloat16; do
  t=$(date +%s)
  python3 -m vllm.entrypoints.openai.api_server --model $D/base --served-model-name base --port 8010 \
    --dtype $dt --enforce-eager --max-model-len 2048 --max-num-seqs 8 --gpu-memory-utilization 0.3 \
    --enable-lora --max-lora-rank 16 --max-loras 3 --lora-modules $mods > $D/vllm-$dt.log 2>&1 &
  pid=$!
  until curl -sf localhost:8010/v1/models >/dev/null; do sleep 1; kill -0 $pid 2>/dev/null || break; [ $(( $(date +%s) - t )) -gt 200 ] && break; done
  echo "vllm $dt eager ready after $(( $(date +%s) - t )) s"
  grep -E "attention backend|Using .*backend|dtype" $D/vllm-$dt.log | head -5
  kill -0 $pid 2>/dev/null || { tail -40 $D/vllm-$dt.log; continue; }
  args=""; for a in gpu-bf16 gpu-fp32 cpu; do [ -d $D/$a ] && args="$args --model $a"; done
  python3 bench/parity/vllm_exact.py --url http://127.0.0.1:8010 --test $D/test/test.jsonl $args --label "vllm $dt" | tee -a $OUT/diag.jsonl
  refs="cpu=.dev-demo/part4/cpu-reference.json"
  [ -f $D/gpu-bf16/parity-reference.json ] && refs="$refs gpu-bf16=$D/gpu-bf16/parity-reference.json"
  python3 bench/parity/check_served.py --url http://127.0.0.1:8010 --dtype $dt --label "parity $dt" $refs | tee -a $OUT/diag.jsonl
  kill -INT $pid; wait $pid
done
cp $D/train-*.log $OUT/ 2>/dev/null
