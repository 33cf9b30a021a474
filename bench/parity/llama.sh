#!/usr/bin/env bash
# Call 3 of the Llama-shape parity run (bench/parity/README.md), from the repository root on
# the GPU machine, after bench/serving's two staging calls (vLLM in /tmp/site, the tokenizer
# in /tmp/stage): carries .dev-llama (the bitsandbytes wheel, for the nf4 reference), installs
# it and the trainer into /tmp/site, and runs llama_shape.py, which writes $OUT/llama.json.
set -uo pipefail
t0=${CALL_T0:-$(date +%s)}  # the call's start, when staging ran before in the same call
S=/tmp/site
export PYTHONPATH=$S PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
[ -f $S/.installed ] || { echo "vLLM is not installed: run bench/serving's staging calls first" >&2; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S .dev-llama/bitsandbytes-*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S \
  libs/lorastack services/trainer services/inference services/gateway apps/lorastack || exit 1
echo "installed in $(( $(date +%s) - t0 )) s"
timeout -s INT $(( 590 - ($(date +%s) - t0) )) python3 bench/parity/llama_shape.py \
  --tokenizer /tmp/stage/tokenizer --out "$OUT/llama.json" "$@" 2>&1 | tee "$OUT/llama.log"
echo "the call took $(( $(date +%s) - t0 )) s"
