#!/usr/bin/env bash
# Train the runs bench/parity/variants.py compares (issue 57), in LORASTACK_HOME (default
# /tmp/parity-variants): the demo run with checkpoints every 5 steps (the right adapter and
# its early checkpoints), one on attention modules only, one with another seed; then the
# table (HF on this machine, float32 / bfloat16 / float16) and the test fixture.
#   bash bench/parity/variants.sh > bench/parity/results/DATE-COMMIT-variants.json
set -euo pipefail
cd "$(dirname "$0")/../.."
export LORASTACK_HOME=${LORASTACK_HOME:-/tmp/parity-variants} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
L=.venv/bin/lorastack
C=services/trainer/src/trainer/configs/demo.yaml
D=$LORASTACK_HOME/demo-dates.jsonl
mkdir -p "$LORASTACK_HOME"
{
  $L model import-default
  $L data make-demo "$D"
  # seconds_per_step: the estimate's step time, instead of a smoke run per output
  common=(dataset.path="$D" seconds_per_step=5)
  $L train $C "${common[@]}" checkpoint_every=5 keep_checkpoints=5
  $L train $C "${common[@]}" output=date-attn 'lora.target_modules=[q_proj,k_proj,v_proj,o_proj]'
  $L train $C "${common[@]}" output=date-seed1 seed=1
} >&2
.venv/bin/python bench/parity/variants.py --fixture "${FIXTURE:-libs/lorastack/tests/data/parity-variants.json}"
