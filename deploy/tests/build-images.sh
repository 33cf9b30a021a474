#!/usr/bin/env bash
# Build lorastack's four images from their real Dockerfiles, one after the other (a
# build takes every core), on the stand-in Python base (standins/build.sh) and with the
# CPU build of torch in deploy/wheels/. Prints each build's time and each image's size.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/tests/buildkit.sh
base=${PYTHON_IMAGE:-lorastack-standin/python:3.11}
wheel_dir=${TORCH_WHEEL_DIR:-/opt/wheels}
if ! ls deploy/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  cp "$wheel_dir"/torch-2.13.0+cpu-*.whl deploy/wheels/ ||
    { echo "error: no torch-2.13.0+cpu wheel in $wheel_dir (set TORCH_WHEEL_DIR)" >&2; exit 2; }
fi
# The trainer's and merger's versions: the CPU venv's, as deploy/compose.cpu.yaml passes
# them (the Dockerfiles' defaults are the versions measured on a GPU).
cpu_versions=(--build-arg TORCH_VERSION=2.13.0 --build-arg TRANSFORMERS_VERSION=5.19.0
  --build-arg PEFT_VERSION=0.21.2 --build-arg HUGGINGFACE_HUB_VERSION=2.4.0
  --build-arg BITSANDBYTES_VERSION=0.50.2)
# image tag = what compose.yaml + deploy/compose.cpu.yaml name them; "cpu" = cpu_versions
images=(
  "lorastack/gateway:0.1.0 services/gateway/Dockerfile"
  "lorastack/trainer:0.1.0 services/trainer/Dockerfile cpu"
  "lorastack/merger:0.1.0 services/merger/Dockerfile cpu"
  "lorastack/inference-cpu:0.1.0 services/inference/Dockerfile.cpu"
)
for entry in "${images[@]}"; do
  read -r tag dockerfile versions <<<"$entry"
  args=(--build-arg PYTHON_IMAGE="$base")
  if [ "$versions" = cpu ]; then args+=("${cpu_versions[@]}"); fi
  start=$(date +%s)
  echo "== build $tag from $dockerfile"
  buildkit_build --progress=plain "${args[@]}" -f "$dockerfile" -t "$tag" . \
    > "${BUILD_LOG_DIR:-/tmp}/lorastack-build-${tag//[\/:]/_}.log" 2>&1 ||
    { tail -40 "${BUILD_LOG_DIR:-/tmp}/lorastack-build-${tag//[\/:]/_}.log" >&2; exit 1; }
  echo "   built in $(( $(date +%s) - start )) s, $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.2f GB", $1/1e9}')"
done
