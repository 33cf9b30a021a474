# Sourced: `buildkit_build ARGS...` runs `docker build` with BuildKit (cache mounts,
# secrets). A docker CLI without the buildx plugin refuses BuildKit; Debian's docker.io
# ships a 20.10 CLI (/usr/bin/docker) whose builder is the daemon's own BuildKit.
buildkit_build() {
  if docker buildx version >/dev/null 2>&1; then
    DOCKER_BUILDKIT=1 docker build "$@"
  elif [ -x /usr/bin/docker ]; then
    DOCKER_BUILDKIT=1 /usr/bin/docker build "$@"
  else
    echo "error: no docker CLI with BuildKit (install docker-buildx or docker.io)" >&2
    return 1
  fi
}
