#!/usr/bin/env bash
# The H200 serving check (bench/serving/README.md), run from the repository root on the device.
#
#   device_check.sh --install   call 2: joins vLLM's two parts (part 1 copied to /tmp/stage by
#                               call 1, part 2 carried now), unpacks it into /tmp/site, installs
#                               the carried wheels and lorastack there and writes their bytecode
#                               (as an image's pip install does), then stops
#   device_check.sh [ARGS]      call 3: runs bench/serving/gpu_serving.py ARGS, which writes
#                               $OUT/serving.json (installs first if call 2 did not)
set -uo pipefail
t0=$(date +%s)
S=/tmp/site
export PYTHONPATH=$S PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
if [ ! -f $S/.installed ]; then
  [ -f /tmp/stage/vllm.tar.xz.00 ] || { echo "no /tmp/stage/vllm.tar.xz.00: the machine went back after call 1; run call 1 again" >&2; exit 3; }
  mkdir -p $S
  cat /tmp/stage/vllm.tar.xz.00 .dev-serve/part2/vllm.tar.xz.01 | python3 -c "
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz') as t:
    t.extractall('$S', filter='fully_trusted')" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S .dev-serve/part2/whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S \
    libs/lorastack services/inference services/gateway apps/lorastack tools/evaluation || exit 1
  python3 -m compileall -q -j 0 $S >/dev/null 2>&1
  touch $S/.installed
  echo "installed in $(( $(date +%s) - t0 )) s"
fi
python3 -c "import vllm, inference.supervisor, gateway.main, evaluation.cli; print('vllm', vllm.__version__)" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
[ "${1:-}" = --install ] && exit 0
# ends before the call's 600 s: SIGINT lets the check stop its servers and write its JSON
timeout -s INT $(( 585 - ($(date +%s) - t0) )) python3 bench/serving/gpu_serving.py \
  --tokenizer /tmp/stage/tokenizer --layers "${LAYERS:-8}" --out "$OUT/serving.json" "$@" 2>&1 | tee "$OUT/check.log"
echo "the check took $(( $(date +%s) - t0 )) s"
