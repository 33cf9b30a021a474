#!/usr/bin/env bash
# `lorastack gateway --workers N` on the GPU machine's 16 cores (bench/gateway/README.md,
# "Several workers"), from the repository root there: in one call that carries .dev-gw (the
# gateway's wheels the machine lacks: fastapi, uvicorn, pydantic, ..., `pip download` of
# services/gateway/requirements.txt's pins) and .dev-serve/part1/tokenizer, or after
# bench/serving's two staging calls (their wheels hold the gateway's); installs them,
# lorastack_testing (the fake vLLM) and this tree's gateway, then runs gateway_latency.py
# for each worker count in $WORKERS (default 1 2 4): the gateway on cores 0..N-1, the fake
# on 4-9, the client on 10-15; $OUT/gw-wN.json each. $TOKENIZER: the tokenizer folder.
# The peer: Debian 12's nginx binary in .dev-gw/bin (`apt-get download nginx`, `dpkg -x`;
# glibc >= 2.34), measured in the same run through --peer-nginx when it starts there
# (NGINX=0: not). $EXTRA: more gateway_latency.py arguments; the throughput scaling
# (README, "Several workers"): WORKERS="1 4" LEVELS="256 512" NGINX=0
# EXTRA="--pace 0.0025 --fakes 3 --client-procs 3". GATEWAY_CPUS (a comma list, the first N
# for N workers: e.g. one hyperthread a core where cores have two), UPSTREAM_CPUS,
# CLIENT_CPUS: other pins. PROFILE=1: py-spy (its wheel carried in .dev-prof) samples every
# process of each run at PROFILE_RATE Hz (200) into $OUT/gw-wN.pyspy.txt (collapsed stacks,
# one line per stack and process: bench/gateway/profile_summary.py reads them).
set -uo pipefail
t0=$(date +%s)
S=/tmp/site
export PYTHONPATH=$S PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache HF_HUB_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE
if compgen -G ".dev-gw/*.whl" >/dev/null; then  # the gateway's wheels, carried (no vLLM staging)
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target $S .dev-gw/*.whl || exit 1
else
  [ -f $S/.installed ] || { echo "run bench/serving's staging calls first, or carry .dev-gw" >&2; exit 3; }
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target $S \
  libs/lorastack libs/testing services/gateway apps/lorastack || exit 1
PEER=""
if [ "${NGINX:-1}" = 1 ] && [ -x .dev-gw/bin/nginx ] && .dev-gw/bin/nginx -v 2>&1; then
  export PATH=$PWD/.dev-gw/bin:$PATH; PEER=--peer-nginx
fi
# the physical cores: CPUs listed together share one (hyperthreads)
echo "thread siblings: $(cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | sort -un | tr '\n' ' ')"
for w in ${WORKERS:-1 2 4}; do
  gw_cpus="0-$((w - 1))"
  if [ -n "${GATEWAY_CPUS:-}" ]; then  # e.g. "0,2,4,6": the first w of them
    gw_cpus=$(echo "$GATEWAY_CPUS" | cut -d, -f1-"$w")
  fi
  prof=()
  if [ -n "${PROFILE:-}" ]; then  # py-spy (carried in .dev-prof) samples every process of the run
    [ -x /tmp/prof/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/prof .dev-prof/py_spy-*.whl || exit 1
    prof=(/tmp/prof/bin/py-spy record --subprocesses --nonblocking -r "${PROFILE_RATE:-200}" -f raw -o "$OUT/gw-w$w.pyspy.txt" --)
  fi
  timeout 170 "${prof[@]}" python3 bench/gateway/gateway_latency.py --tokenizer "${TOKENIZER:-/tmp/stage/tokenizer}" \
    --duration "${DURATION:-8}" --concurrency ${LEVELS:-64 256} --keep-alive --workers "$w" $PEER \
    --pin-gateway "$gw_cpus" --pin-upstream "${UPSTREAM_CPUS:-4-9}" --pin-client "${CLIENT_CPUS:-10-15}" ${EXTRA:-} \
    > "$OUT/gw-w$w.json" 2> "$OUT/gw-w$w.log"
  echo "workers $w: rc $? at $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/gw-w$w.log"
  [ -z "${PROFILE:-}" ] || sed -i '/^py-spy> /d' "$OUT/gw-w$w.json"  # py-spy's lines share stdout
  PEER=""  # nginx, one process: the floor per core, measured beside the first count only
done
echo "the call took $(( $(date +%s) - t0 )) s"
