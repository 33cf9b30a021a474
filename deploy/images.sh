#!/usr/bin/env bash
# lorastack's images under one tag: `make images` builds them, `make push-images` pushes them,
# `deploy/images.sh list` prints their names. REGISTRY (e.g. registry.example.com/team) is
# put before every name; TAG is the one tag of all (default: the version the manifests and
# compose.yaml name). Set the same REGISTRY and TAG in deploy/k8s/base/kustomization.yaml's
# `images:` block (README, "On Kubernetes").
#   make images push-images REGISTRY=registry.example.com/team TAG=0.1.0
# inference is vLLM's CUDA image (services/inference/Dockerfile: ~10 GB, a long build).
set -euo pipefail
cd "$(dirname "$0")/.."
action=${1:-build}
tag=${TAG:-0.1.0}
prefix=${REGISTRY:+${REGISTRY%/}/}
images=(
  "gateway services/gateway/Dockerfile"
  "inference services/inference/Dockerfile"
  "trainer services/trainer/Dockerfile"
  "merger services/merger/Dockerfile"
)
for entry in "${images[@]}"; do
  read -r name dockerfile <<<"$entry"
  ref="${prefix}lorastack/${name}:${tag}"
  case $action in
    list) echo "$ref" ;;
    build) DOCKER_BUILDKIT=1 docker build -f "$dockerfile" -t "$ref" . ;;
    push) docker push "$ref" ;;
    *) echo "usage: deploy/images.sh build|push|list (REGISTRY=..., TAG=...)" >&2; exit 2 ;;
  esac
done
