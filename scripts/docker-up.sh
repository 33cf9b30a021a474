#!/usr/bin/env bash
# Make a Docker engine answer on this machine: install Debian's docker.io, docker-compose
# (1.29, the Python one) and mmdebstrap when missing, and start dockerd by hand when no
# init system runs it. Used by `make test-compose`; harmless where Docker already runs.
set -euo pipefail
log=${DOCKERD_LOG:-/tmp/lorastack-dockerd.log}
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "error: ${need[*]} missing and not root; install them" >&2; exit 2; }
  echo "installing ${need[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${need[@]}" uidmap iptables >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: $log)"
  setsid dockerd >"$log" 2>&1 < /dev/null &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$log" >&2; echo "error: dockerd did not start" >&2; exit 1; }
fi
echo "docker: $(docker version --format '{{.Server.Version}}'), $(docker-compose version --short)"
