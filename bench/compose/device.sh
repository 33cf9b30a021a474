#!/usr/bin/env bash
# The GPU compose walk (bench/compose/README.md), from the repository root on the GPU machine,
# after bench/serving's two staging calls (vLLM 0.26 and its wheels in /tmp/site, the SmolLM2
# tokenizer in /tmp/stage/tokenizer). Every call sends the same command:
#
#   bash bench/compose/device.sh [walk.py ARGS]
#
# The first call carries .dev-compose/whl and .dev-compose/render (bench/compose/stage.sh):
# it installs the wheels (whl/site into /tmp/site beside vLLM: the store client and moto's
# server; whl/jobs into /tmp/jobs, ahead on the path of the trainer, merger and gateway images
# only: transformers 5.19.0, huggingface_hub 2.4.0, bitsandbytes 0.50.2), the test support, the
# trainer and the merger, and keeps the render in /tmp/compose-walk. Then, in every call, the
# walk goes on from its state until ~25 s before the call's 600 s (exit 3: send the same call
# again at once; exit 0: done; exit 1: failed, the log tail above says where). What it started
# (the store, vLLM, the gateway, a job still running) runs on under setsid between the calls.
# $OUT gets compose-walk.json, compose-logs.tar.gz and walk.log.
set -uo pipefail
t0=${CALL_T0:-$(date +%s)}
S=/tmp/site J=/tmp/jobs W=/tmp/compose-walk
export PYTHONPATH=$S PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
[ -f $S/.installed ] || { echo "vLLM is not installed: send bench/serving's staging calls 1 and 2 first" >&2; exit 3; }
[ -d /tmp/stage/tokenizer ] || { echo "no /tmp/stage/tokenizer: send bench/serving's staging call 1 again" >&2; exit 3; }
code=(libs/lorastack libs/testing services/trainer services/merger services/inference services/gateway apps/lorastack)
if [ ! -f $S/.compose-installed ]; then
  [ -d .dev-compose/whl ] || { echo "carry .dev-compose/whl and .dev-compose/render in the walk's first call" >&2; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S .dev-compose/whl/site/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $J .dev-compose/whl/jobs/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S "${code[@]}" || exit 1
  python3 -m compileall -q -j 0 $J >/dev/null 2>&1
  mkdir -p $W/render && cp -r .dev-compose/render/. $W/render/
  touch $S/.compose-installed
  echo "compose walk installed in $(( $(date +%s) - t0 )) s"
else  # this tree's code again (the call may carry a newer commit than the install's)
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S "${code[@]}" || exit 1
fi
# pip --target --upgrade replaces $S/bin with the last install's scripts alone: the stand-in
# store's command (moto_server) written again, as its console script would be
[ -x $S/bin/moto_server ] || { printf '#!/bin/sh\nexec python3 -m moto.server "$@"\n' > $S/bin/moto_server && chmod +x $S/bin/moto_server; }
# every image's python imports what its processes need, or the call stops here
python3 -c "import moto.server, flask, boto3, vllm, inference.supervisor, gateway.main, lorastack_testing.fake_hub, openai" || exit 1
PYTHONPATH=$J:$S python3 -c "
import transformers, huggingface_hub, bitsandbytes, peft, torch, trainer.cli, merger.cli, gateway.main, lorastack.hub
print('jobs: torch', torch.__version__, 'transformers', transformers.__version__, 'hub', huggingface_hub.__version__,
      'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)" || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h /tmp | tail -1
sites=(--image-site "lorastack/trainer:0.1.0=$J" --image-site "lorastack/merger:0.1.0=$J"
       --image-site "lorastack/gateway:0.1.0=$J")
left=$(( 575 - ($(date +%s) - t0) ))
timeout -s INT $(( left + 15 )) python3 bench/compose/walk.py --render $W/render --work $W \
  --tokenizer /tmp/stage/tokenizer "${sites[@]}" --deadline-s $left "$@" 2>&1 | tee -a "$OUT/walk.log"
rc=${PIPESTATUS[0]}
df -h /tmp | tail -1
echo "the call took $(( $(date +%s) - t0 )) s; walk rc $rc (3: send the same call again)"
exit $rc
