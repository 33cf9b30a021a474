#!/usr/bin/env bash
# This tree's gateway against an older one on the GPU machine's cores, interleaved $ROUNDS
# times (default 3) in one call, the same harness and pins as device_workers.sh. Carries
# .dev-gw (as device_workers.sh) and $OLD (default .dev-old: `git archive REV libs/lorastack
# services/gateway apps/lorastack`, extracted); writes $OUT/ab-{new,old}-{1,2,..}.json.
# Defaults: one worker at 64 streams (the A/B against c7ab869, before `--workers`);
# WORKERS, LEVELS, DURATION, GATEWAY_CPUS (default 0-(WORKERS-1)) and EXTRA (more
# gateway_latency.py arguments) as device_workers.sh.
set -uo pipefail
t0=$(date +%s)
S=/tmp/site O=/tmp/site-old
export PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache HF_HUB_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE
old=${OLD:-.dev-old} w=${WORKERS:-1}
pip() { PYTHONPATH=$S python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade "$@"; }
pip --target $S .dev-gw/*.whl && pip --target $S libs/lorastack libs/testing services/gateway apps/lorastack \
  && pip --target $O $old/libs/lorastack $old/services/gateway $old/apps/lorastack || exit 1
for round in $(seq 1 "${ROUNDS:-3}"); do
  for arm in new old; do
    path=$S; [ $arm = old ] && path=$O:$S
    f=$OUT/ab-$arm-$round.json
    PYTHONPATH=$path timeout 170 python3 bench/gateway/gateway_latency.py --tokenizer "${TOKENIZER:-/tmp/stage/tokenizer}" \
      --duration "${DURATION:-8}" --concurrency ${LEVELS:-64} --keep-alive --workers "$w" \
      --pin-gateway "${GATEWAY_CPUS:-0-$((w - 1))}" --pin-upstream 4-9 --pin-client 10-15 ${EXTRA:-} \
      > "$f" 2>> "$OUT/ab.log"
    echo "$arm $round (rc $?): $(python3 -c '
import json, sys
for p in json.load(open(sys.argv[1]))["points"]:
    print(p["concurrency"], "streams: added TTFT p50/p99 ms", p["ttft_p50_added_ms"], p["ttft_p99_added_ms"],
          "gateway req/s", p["gateway"]["requests_per_s"], "cores busy", p.get("gateway_cores_busy"))' "$f")"
  done
done
echo "the call took $(( $(date +%s) - t0 )) s"
