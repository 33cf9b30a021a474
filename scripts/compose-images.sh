#!/usr/bin/env bash
# The images `make test-compose` runs, built (its first phases): Docker started (installed
# where missing), the stand-in images no registry gives us here, and our four images from
# their Dockerfiles. Harmless where they are built: the stand-ins are kept, ours come from
# the build cache in seconds. CI (.ci/run) starts it beside `make test`: the builds wait on
# downloads while the suite waits on its processes.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
phase() { echo "== $1 ($(( $(date +%s) - t0 )) s so far)"; }
phase "docker"
scripts/docker-up.sh
phase "stand-in images"
deploy/tests/standins/build.sh
phase "our images"
deploy/tests/build-images.sh
phase "images built"
