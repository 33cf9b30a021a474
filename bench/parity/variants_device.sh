# issue 57 (through device.sh, on the GPU machine): bench/parity/variants.py's table with a
# GPU-trained reference (bf16, as a GPU user's adapter is recorded): the demo run with
# checkpoints every 5 steps, one on attention modules only, one with another seed; then
# CUDA vLLM 0.26 in float16 (the dtype auto serves LoRA adapters in on CUDA) and Hugging
# Face on the GPU in float32 / bfloat16 / float16, then vLLM in bfloat16 while time is left.
set -uo pipefail
t0=${CALL_T0:-$(date +%s)}
L="python3 -m lorastack.cli"
C=services/trainer/src/trainer/configs/demo.yaml
D=$LORASTACK_HOME/demo-dates.jsonl
quiet() { grep -vE "^step [0-9]+/|it/s\]|Loading weights" || true; }
$L model import-default 2>&1 | quiet
$L data make-demo "$D" 2>&1 | quiet
common=(dataset.path="$D" seconds_per_step=2)
$L train $C "${common[@]}" checkpoint_every=5 keep_checkpoints=5 2>&1 | quiet
$L train $C "${common[@]}" output=date-attn 'lora.target_modules=[q_proj,k_proj,v_proj,o_proj]' 2>&1 | quiet
$L train $C "${common[@]}" output=date-seed1 seed=1 2>&1 | quiet
echo "trained after $(( $(date +%s) - t0 )) s"
python3 bench/parity/variants.py --device cuda --dtypes float16,bfloat16,float32 \
  --vllm-dtypes float16 --fixture "$OUT/parity-variants-gpu.json" > "$OUT/variants-gpu.json"
echo "vLLM float16 + HF arms after $(( $(date +%s) - t0 )) s"
if [ $(( $(date +%s) - t0 )) -lt 430 ]; then
  python3 bench/parity/variants.py --device cuda --hf 0 --vllm-dtypes bfloat16 > "$OUT/variants-gpu-bf16.json"
  echo "vLLM bfloat16 arm after $(( $(date +%s) - t0 )) s"
fi
