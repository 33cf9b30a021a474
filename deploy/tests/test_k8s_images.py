"""Every lorastack container the Kubernetes targets start, run in its built image in its
check mode (`make test-compose`, once the images are built; the compose walk follows).

Each target is rendered by `kubectl kustomize` with a user's values, and each container
taken as tests/test_k8s_containers.py takes it (tests/k8s_render.py: its env from the
ConfigMaps, Secrets and `env` of the manifest, `$(VAR)` expanded; its mounted ConfigMap
and Secret files; torchrun's command as its rank 0 with torchrun's variables). Here that
command runs with `--check` in the image the manifest names, one `docker run` a container:

    docker run --rm --pull never --network none --env-file ENV --user UID:GID --read-only \\
        --cap-drop ALL --security-opt no-new-privileges -v FILES:/config:ro ... \\
        IMAGE lorastack ARGS --check

(the files written to a temporary folder and bind-mounted, read-only, at their mount
paths; emptyDirs and claims as empty writable folders; `--read-only` where the manifest
asks for a read-only root filesystem). A container the targets share is run once.

So what is checked is the image's own code, its installed packages and entry points, as
the pod's user with the pod's files, and nothing reaches a network: settings, config,
secrets and placeholders, torchrun's processes. A value left as the example's
`REPLACE_ME` is refused in the image too (the near misses below).

Stand-in: `lorastack/inference` is vLLM's CUDA image (`make images`; ~10 GB); here its CPU
build, `lorastack/inference-cpu` (deploy/tests/build-images.sh), the same lorastack code
and `lorastack serve`. Redis, MinIO and its `mc` Job run no lorastack code and no image of
theirs can be pulled here: tests/test_k8s_containers.py holds their Secret values to the
placeholder rule.
"""

from __future__ import annotations

import functools
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from k8s_render import TARGETS, Pod, check_mode, lorastack_pods, render, render_copy

# an image the manifests name -> the one built here in its place
STAND_INS = {"lorastack/inference": "lorastack/inference-cpu"}
TIMEOUT_S = 180


def local_image(ref: str) -> str:
    name, _, tag = ref.rpartition(":")
    return f"{STAND_INS.get(name, name)}:{tag}"


@functools.cache
def docker_ok() -> None:
    r = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"no Docker engine (scripts/docker-up.sh starts one):\n{r.stderr}"


def docker_run(pod: Pod, work: Path) -> list[str]:
    """The `docker run` of the pod's check: its image, env, files, user and restrictions."""
    args, extra = check_mode(pod)
    env = pod.env | extra
    bad = [k for k, v in env.items() if "\n" in v]
    assert not bad, f"a multi-line env value (an env file cannot hold it): {bad}"
    env_file = work / "env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
    # --pull never: the image built here or a failure, never a registry's
    argv = ["docker", "run", "--rm", "--pull", "never", "--network", "none"]
    argv += ["--env-file", str(env_file)]
    argv += ["--user", pod.user, "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if pod.read_only_root:
        argv.append("--read-only")
    for path, folder in sorted(pod.mounts.items()):
        argv += ["-v", f"{folder}:{path}" + (":ro" if path in pod.file_mounts else "")]
    argv.append(local_image(pod.image))
    # torchrun starts `python -m lorastack.cli` (its -m); `lorastack` is the same entry point
    runner = ["lorastack"] if pod.args[0] == "lorastack" else ["python3", "-m", "lorastack.cli"]
    return [*argv, *runner, *args]


def run_in_image(pod: Pod, work: Path) -> tuple[int, str]:
    """(exit code, the command and its output) of the pod's check in its image."""
    work.mkdir(parents=True)
    argv = docker_run(pod, work)
    r = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=TIMEOUT_S)
    return r.returncode, f"$ {' '.join(argv)}\n{r.stdout}{r.stderr}"


# one value a user could miss, the container whose image must refuse it, what it says
MISSED = [
    ("redis", "REDIS_PASSWORD", "gateway", "redis_url's password is the placeholder"),
    ("vllm-api-key", "LORASTACK_VLLM_API_KEY", "inference", "vllm_api_key is the placeholder"),
    (
        "trainer",
        "LORASTACK_S3_SECRET_ACCESS_KEY",
        "trainer",
        "s3_secret_access_key is the placeholder",
    ),
]
# every lorastack command the targets run (`lorastack model import`, train, merge, serve, gateway)
CHECKED = {"model", "train", "merge", "serve", "gateway"}
Results = dict[tuple[str, str], tuple[str, int, str]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Every check of this file, run at once: {(target, workload): (its lorastack command,
    exit code, output)} for each target's containers (one run per distinct container: the
    targets share most), and {(missed key, workload): ...} for the near misses. A few
    `docker run`s at a time: most of each is the engine starting a container and Python
    importing."""
    docker_ok()
    root = tmp_path_factory.mktemp("k8s-images")
    pods: dict[tuple[str, str], Pod] = {}
    for i, target in enumerate(TARGETS):
        for name, pod in lorastack_pods(render(target), root / f"target-{i}"):
            pods[(target, name)] = pod
    for stem, key, workload, _ in MISSED:  # one secrets file left with its REPLACE_ME
        folder = root / f"missed-{key}-{workload}"
        docs = render_copy(TARGETS[0], folder / "render", leave=(stem, key))
        (pod,) = [p for name, p in lorastack_pods(docs, folder / "pods") if name == workload]
        assert pod.env[key].startswith("REPLACE_ME"), pod.env[key]
        pods[(key, workload)] = pod
    distinct = {pod.fingerprint(): pod for pod in pods.values()}
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        done = dict(
            zip(
                distinct,
                pool.map(lambda kv: run_in_image(kv[1], root / "runs" / kv[0]), distinct.items()),
                strict=True,
            )
        )
    return {at: (pod.lorastack_argv()[0], *done[pod.fingerprint()]) for at, pod in pods.items()}


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_container_passes_its_check_in_its_image(
    target: str, results: Results
) -> None:
    ran = {name: out for (t, name), out in results.items() if t == target}
    assert {command for command, _, _ in ran.values()} == CHECKED, (target, ran.keys())
    for name, (_, code, output) in ran.items():
        assert code == 0 and "check passed" in output, (target, name, output)


@pytest.mark.parametrize(("stem", "key", "workload", "says"), MISSED)
def test_a_value_left_as_shipped_is_refused_in_the_image(
    stem: str, key: str, workload: str, says: str, results: Results
) -> None:
    """The near miss: the secrets file `stem` written from the example with `key` unedited
    (`REPLACE_ME`), every other value the user's."""
    _, code, output = results[(key, workload)]
    assert code != 0 and says in output, output
