#!/usr/bin/env bash
# `make test-compose`: the compose path for real, on the CPU override. Starts Docker when
# it is missing (Debian's docker.io), builds the stand-in images no registry gives us here
# and our four images from their Dockerfiles (scripts/compose-images.sh), runs every container the Kubernetes targets
# start in its check mode inside those images (deploy/tests/test_k8s_images.py), then walks
# the README's "On a GPU host" steps through the containers (deploy/tests/test_compose_walk.py)
# and takes it all down.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
phase() { echo "== $1 ($(( $(date +%s) - t0 )) s so far)"; }
phase "docker and the images"
scripts/compose-images.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
phase "k8s containers in the images"
.venv/bin/python -m pytest -p no:cacheprovider -v deploy/tests/test_k8s_images.py
phase "the walk"
.venv/bin/python -m pytest -p no:cacheprovider -s -v deploy/tests/test_compose_walk.py "$@"
phase "done"
