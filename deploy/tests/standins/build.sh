#!/usr/bin/env bash
# Stand-in images for `make test-compose`, where no registry image can be pulled.
# Each is tagged under lorastack-standin/* and says which real image it stands for:
#   lorastack-standin/python:3.11     for python:3.11.7-slim-bookworm: Debian 12 bookworm
#                                     (minbase, python3 3.11.2, pip) from mmdebstrap, plus
#                                     this machine's CA bundle (TLS to the package index is
#                                     intercepted here, pip needs it: PIP_CERT)
#   lorastack-standin/s3:moto-5.2.5   for MinIO: moto's S3 server (no MinIO binary reachable)
#   lorastack-standin/prometheus:debian for prom/prometheus: Debian's prometheus package
# Grafana has no stand-in (no binary reachable): the test runs every dashboard query
# against the real Prometheus instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base=lorastack-standin/python:3.11
ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
if ! docker image inspect "$base" >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "stand-in $base: mmdebstrap bookworm"
  # The customize hook runs on the host, after packages: drop PEP 668's marker (the
  # official image's pip installs system-wide too) and add the CA bundle.
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,wget \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
    --customize-hook="cp $ca \"\$1\"/usr/local/share/lorastack-ca.crt" \
    --customize-hook='cat "$1"/usr/local/share/lorastack-ca.crt > "$1"/etc/ssl/certs/ca-certificates.crt' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$tmp/base.tar"
  docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' \
    -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    -c 'CMD ["python3"]' \
    "$tmp/base.tar" "$base" >/dev/null
fi
source "$here/../buildkit.sh"
for name in s3 prometheus; do
  echo "stand-in $name: $here/$name.Dockerfile"
  buildkit_build -q --build-arg PYTHON_IMAGE="$base" -f "$here/$name.Dockerfile" \
    -t "lorastack-standin/$name:test" "$here" >/dev/null
done
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' 'lorastack-standin/*'
