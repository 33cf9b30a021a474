#!/usr/bin/env bash
# One gateway worker at 64 streams on the GPU machine's cores: this tree's gateway against
# the one before `--workers` (c7ab869, where the issue's 0.53-0.65 ms came from), the two
# interleaved three times in one call, the same harness and pins as device_workers.sh.
# Carries .dev-gw (as device_workers.sh) and .dev-old (`git archive c7ab869 libs/lorastack
# services/gateway apps/lorastack`); writes $OUT/ab-{new,old}-{1,2,3}.json.
set -uo pipefail
t0=$(date +%s)
S=/tmp/site O=/tmp/site-old
export PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache HF_HUB_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE
pip() { PYTHONPATH=$S python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade "$@"; }
pip --target $S .dev-gw/*.whl && pip --target $S libs/lorastack libs/testing services/gateway apps/lorastack \
  && pip --target $O .dev-old/libs/lorastack .dev-old/services/gateway .dev-old/apps/lorastack || exit 1
for round in 1 2 3; do
  for arm in new old; do
    path=$S; [ $arm = old ] && path=$O:$S
    f=$OUT/ab-$arm-$round.json
    PYTHONPATH=$path timeout 60 python3 bench/gateway/gateway_latency.py --tokenizer "${TOKENIZER:-/tmp/stage/tokenizer}" \
      --duration 8 --concurrency 64 --keep-alive --workers 1 \
      --pin-gateway 0-0 --pin-upstream 4-9 --pin-client 10-15 > "$f" 2>> "$OUT/ab.log"
    echo "$arm $round (rc $?): $(python3 -c 'import json, sys; p = json.load(open(sys.argv[1]))["points"][0]; print("added TTFT p50/p99 ms", p["ttft_p50_added_ms"], p["ttft_p99_added_ms"], "gateway req/s", p["gateway"]["requests_per_s"])' "$f")"
  done
done
echo "the call took $(( $(date +%s) - t0 )) s"
