"""Every container the Kubernetes targets would start, started here in its check mode: each
target rendered by `kubectl kustomize` with a user's values (tests/k8s_render.py), and
each lorastack container's own command run with `--check` by the venv's interpreter, in a
process whose environment is only what the manifest gives it (ConfigMaps, Secrets, env,
`$(VAR)` expanded as the kubelet does) and whose mounted ConfigMap files are written where
its paths point. A torchrun command runs as torchrun would run its rank 0: `python -m
lorastack.cli ...` with WORLD_SIZE, RANK and LOCAL_RANK from torchrun's own parser of the
manifest's arguments. The other containers (Redis, MinIO, its init Job) run no lorastack
code: every value they take from a Secret is held to the same placeholder rule.

What a check mode checks is the service's (`--check` of `lorastack train`, `serve`,
`gateway`, `model import`: settings, config, secrets, processes; nothing is fetched or
started). The same checks in the built images, each container a `docker run` of its image
with the same env and files: deploy/tests/test_k8s_images.py (`make test-compose`, where
Docker runs). Not run anywhere: a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_render import (
    KINDS,
    REPO,
    TARGETS,
    Pod,
    check_mode,
    containers,
    kustomize,
    render,
    render_copy,
    runs_lorastack,
    secret_problems,
)

CHECKED = ("train", "merge", "serve", "gateway", "model")  # every lorastack command a target runs


def check_command(pod: Pod) -> tuple[list[str], dict[str, str]]:
    """The pod's command in its check mode (k8s_render.check_mode), with paths pointing at
    the files written here, and its environment (the manifest's, torchrun's, a PATH and a
    home folder)."""
    args, extra = check_mode(pod)
    env = {k: pod.local(v) for k, v in pod.env.items()} | extra
    home = pod.local("/home/lorastack")
    env |= {"PATH": os.environ["PATH"], "HOME": home, "PYTHONDONTWRITEBYTECODE": "1"}
    return [sys.executable, "-m", "lorastack.cli", *[pod.local(a) for a in args]], env


_RUNS: dict[str, tuple[int, str]] = {}


def run_check(pod: Pod) -> tuple[int, str]:
    """(exit code, output) of the pod's check; run once per distinct command, environment
    and mounted files as the manifest gives them (the targets share most containers)."""
    key = pod.fingerprint()
    if key not in _RUNS:
        argv, env = check_command(pod)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=120)
        _RUNS[key] = (r.returncode, r.stdout + r.stderr)
    return _RUNS[key]


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_container_passes_its_own_check(target: str, tmp_path: Path) -> None:
    seen = set()
    docs = render(target)
    for name, pod in containers(docs, tmp_path):
        workload = next(d for d in docs if d["metadata"]["name"] == name and d["kind"] in KINDS)
        if not runs_lorastack(workload):
            assert not secret_problems(pod), (name, secret_problems(pod))
            continue
        code, output = run_check(pod)
        assert code == 0 and "check passed" in output, (name, check_command(pod)[0], output)
        seen.add(pod.lorastack_argv()[0])
    assert seen == set(CHECKED), seen


def _failing_check(target: str, workload: str, tmp_path: Path, **render_args: Any) -> str:
    docs = render_copy(target, tmp_path / "render", **render_args)
    (pod,) = [p for name, p in containers(docs, tmp_path / "pods") if name == workload]
    code, output = run_check(pod)
    assert code != 0, f"{workload} passed its check:\n{output}"
    return output


# one value a user could miss, the container whose check must refuse it, what it says
MISSED = [
    ("redis", "REDIS_PASSWORD", "gateway", "redis_url's password is the placeholder"),
    (
        "trainer",
        "LORASTACK_S3_SECRET_ACCESS_KEY",
        "trainer",
        "s3_secret_access_key is the placeholder",
    ),
    (
        "trainer",
        "LORASTACK_S3_ACCESS_KEY_ID",
        "model-import",
        "s3_access_key_id is the placeholder",
    ),
    (
        "gateway",
        "LORASTACK_S3_SECRET_ACCESS_KEY",
        "gateway",
        "s3_secret_access_key is the placeholder",
    ),
    ("inference", "LORASTACK_S3_ACCESS_KEY_ID", "inference", "s3_access_key_id is the placeholder"),
    ("vllm-api-key", "LORASTACK_VLLM_API_KEY", "gateway", "vllm_api_key is the placeholder"),
    ("vllm-api-key", "LORASTACK_VLLM_API_KEY", "inference", "vllm_api_key is the placeholder"),
    ("configmap", "LORASTACK_S3_ENDPOINT_URL", "trainer", "s3_endpoint_url is still the example"),
]


@pytest.mark.parametrize(("stem", "key", "workload", "says"), MISSED)
def test_a_value_left_as_shipped_fails_the_check(
    stem: str, key: str, workload: str, says: str, tmp_path: Path
) -> None:
    output = _failing_check(TARGETS[0], workload, tmp_path, leave=(stem, key))
    assert says in output, output


def test_redis_and_minio_refuse_a_password_left_as_shipped(tmp_path: Path) -> None:
    """Redis and MinIO run no check mode of ours: the values they read from a Secret are
    held to the placeholder rule here."""
    for stem, key, workload in [("redis", "REDIS_PASSWORD", "redis"),
                                ("minio", "MINIO_ROOT_PASSWORD", "minio"),
                                ("minio", "MINIO_ROOT_PASSWORD", "store-init")]:  # fmt: skip
        root = tmp_path / f"{workload}"
        docs = render_copy("deploy/k8s/overlays/minio", root / "render", leave=(stem, key))
        (pod,) = [p for name, p in containers(docs, root / "pods") if name == workload]
        assert any(key in why for why in secret_problems(pod)), (workload, pod.secret_env)


@pytest.mark.parametrize(
    ("overlay", "processes"),
    [("multi-gpu-training", 4), ("multi-node-training", 8)],
)
def test_a_run_config_that_does_not_split_over_the_overlays_processes_fails(
    overlay: str, processes: int, tmp_path: Path
) -> None:
    """The base's run config (grad_accum 1) under an overlay's torchrun: refused, as the
    trainer refuses it at its first step on the GPUs."""
    docs = render(f"deploy/k8s/overlays/{overlay}")
    (pod,) = [p for name, p in containers(docs, tmp_path) if name == "trainer"]
    assert check_command(pod)[1]["WORLD_SIZE"] == str(processes)
    base = REPO / "deploy/k8s/base/config/train.yaml"
    Path(pod.local("/config/train.yaml")).write_text(base.read_text())
    code, output = run_check(pod)
    assert code != 0 and f"does not split over {processes} processes" in output, output


def test_a_trainer_reading_its_own_split_as_its_dataset_fails(tmp_path: Path) -> None:
    docs = render(TARGETS[0])
    (pod,) = [p for name, p in containers(docs, tmp_path) if name == "trainer"]
    config = Path(pod.local("/config/train.yaml"))
    config.write_text(config.read_text().replace("ref: my-data", "ref: my-run/data"))
    code, output = run_check(pod)
    assert code != 0 and "where this run publishes its own split" in output, output


def _images(docs: list[dict[str, Any]]) -> set[str]:
    return {
        c["image"]
        for d in docs
        if d["kind"] in KINDS
        for c in d["spec"]["template"]["spec"]["containers"]
    }


def test_the_images_make_images_builds_are_the_ones_every_target_runs() -> None:
    """One tag for all: each lorastack image a target runs is one `make images` builds,
    under the tag the base's `images:` block sets."""
    listed = subprocess.run(
        [str(REPO / "deploy/images.sh"), "list"], capture_output=True, text=True, check=True,
        env={**os.environ, "REGISTRY": "", "TAG": "0.1.0"},
    ).stdout.split()  # fmt: skip
    for target in TARGETS:
        ours = {i for i in _images(render(target)) if i.startswith("lorastack/")}
        assert ours and ours <= set(listed), (target, ours - set(listed))


def test_a_user_sets_their_registry_in_one_images_block(tmp_path: Path) -> None:
    """What the README says to do: `make push-images REGISTRY=... TAG=...`, then an
    `images:` block (here in a kustomization of the user's own over an overlay) naming the
    same: every lorastack container then runs the pushed image, the others stay."""
    env = {**os.environ, "REGISTRY": "registry.example.com/team", "TAG": "1.2.3"}
    pushed = subprocess.run(
        [str(REPO / "deploy/images.sh"), "list"], capture_output=True, text=True, check=True,
        env=env,
    ).stdout.split()  # fmt: skip
    render_copy("deploy/k8s/overlays/minio", tmp_path)  # the user's values, written there
    mine = tmp_path / "deploy/k8s/mine"
    mine.mkdir()
    images = []
    for ref in pushed:  # REGISTRY/lorastack/NAME:TAG replaces the manifests' lorastack/NAME
        name, tag = ref.rsplit(":", 1)
        images.append({"name": name[name.index("lorastack/") :], "newName": name, "newTag": tag})
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["../overlays/minio"], "images": images})
    )
    r = kustomize(mine)
    assert r.returncode == 0, r.stderr
    running = _images([d for d in yaml.safe_load_all(r.stdout) if d])
    ours = {i for i in running if "lorastack/" in i}
    assert ours and ours <= set(pushed), ours - set(pushed)
    assert {i for i in running if i not in ours} == {
        i for i in _images(render("deploy/k8s/overlays/minio")) if not i.startswith("lorastack/")
    }  # Redis, MinIO, mc: as shipped
