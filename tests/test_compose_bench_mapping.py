"""bench/compose's mapping of a rendered compose service to a host process (issue 62): only what
Docker's namespaces change (volume paths, service host names, each container's own ports,
0.0.0.0, extra_hosts, WORKDIR) is changed; every other argument and env value is passed as
rendered, the image's ENV under compose's environment and its CMD where compose has none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compose_mapping", REPO / "bench/compose/mapping.py")
assert spec is not None and spec.loader is not None
mapping = importlib.util.module_from_spec(spec)
sys.modules["compose_mapping"] = mapping  # dataclasses look their module up there
spec.loader.exec_module(mapping)

RENDER_ROOT = Path("/elsewhere/checkout")
DOCKERFILE = """FROM python:3.11 AS build
ENV BUILD_ONLY=1
FROM python:3.11
ENV PYTHONUNBUFFERED=1 \\
    LORASTACK_HOME=/data/lorastack \\
    LORASTACK_PORT=8000 \\
    LORASTACK_SUPERVISOR_PORT=8001
ENV MPLBACKEND Agg
ENTRYPOINT []
CMD ["lorastack", "serve", "/config/serve.yaml"]
"""
SERVICES = {
    "minio": {"command": ["moto_server", "-H", "0.0.0.0", "-p", "9000"]},
    "init": {
        "entrypoint": ["/bin/sh", "-c"],
        "command": ["python3 -c \"connect('http://minio:9000')\""],
        "volumes": [f"{RENDER_ROOT}/deploy/minio:/policies:ro"],
    },
    "inference": {
        "environment": {"LORASTACK_HOST": "0.0.0.0", "LORASTACK_STORE_URL": "s3://lorastack",
                        "LORASTACK_S3_ENDPOINT_URL": "http://minio:9000", "KEY": "0.0.0.0/8"},
        "volumes": [f"{RENDER_ROOT}/deploy/config:/config:ro", "cache:/data/lorastack:rw"],
        "healthcheck": {"test": ["CMD", "python3", "-c", "urlopen('http://127.0.0.1:8001/ready')"]},
    },
    "gateway": {
        "command": ["lorastack", "gateway"],
        "environment": {"LORASTACK_PORT": "8080", "LORASTACK_BACKENDS": '["http://inference:8000"]',
                        "LORASTACK_SERVE_CONFIG": "/config/serve.yaml", "NOTE": "/configs/x"},
        "volumes": [f"{RENDER_ROOT}/deploy/config:/config:ro"],
        "ports": [{"published": 8080, "target": 8080}],
    },
    "importer": {
        "entrypoint": ["lorastack", "model", "import"],
        "environment": {"HF_ENDPOINT": "http://host.docker.internal:18088"},
        "extra_hosts": {"host.docker.internal": "host-gateway"},
    },
}  # fmt: skip


def layout(tmp: Path) -> object:
    images = {"inference": mapping.parse_image(DOCKERFILE)}
    found = mapping.container_ports(SERVICES, images)
    assert found == {"minio": {9000}, "init": set(), "inference": {8000, 8001},
                     "gateway": {8080}, "importer": set()}  # fmt: skip
    ports = {s: {p: 20000 + p for p in ps} for s, ps in found.items()}
    return images, mapping.Layout(tmp / "repo", RENDER_ROOT, tmp / "work", ports)


def test_a_rendered_service_becomes_the_process_docker_would_run(tmp_path: Path) -> None:
    images, where = layout(tmp_path)
    run = lambda name, args=None: mapping.process_for(name, SERVICES, images, where, args)  # noqa: E731

    minio = run("minio")
    assert minio.argv == ["moto_server", "-H", "127.0.0.1", "-p", "29000"]
    init = run("init")
    assert init.argv == ["/bin/sh", "-c", "python3 -c \"connect('http://127.0.0.1:29000')\""]

    inference = run("inference")  # the image's CMD and ENV (its last stage's), compose's env on top
    assert inference.argv == ["lorastack", "serve", f"{tmp_path}/repo/deploy/config/serve.yaml"]
    assert inference.env == {
        "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
        "LORASTACK_HOME": f"{tmp_path}/work/volumes/cache",
        "LORASTACK_PORT": "28000", "LORASTACK_SUPERVISOR_PORT": "28001",
        "LORASTACK_HOST": "127.0.0.1", "LORASTACK_STORE_URL": "s3://lorastack",
        "LORASTACK_S3_ENDPOINT_URL": "http://127.0.0.1:29000", "KEY": "0.0.0.0/8",
    }  # fmt: skip
    assert inference.cwd == tmp_path / "work" / "home" / "inference"
    assert mapping.healthcheck_for("inference", SERVICES, where) == [
        "python3", "-c", "urlopen('http://127.0.0.1:28001/ready')",
    ]  # fmt: skip

    gateway = run("gateway")
    assert gateway.env["LORASTACK_PORT"] == "28080"
    assert gateway.env["LORASTACK_BACKENDS"] == '["http://127.0.0.1:28000"]'
    assert gateway.env["LORASTACK_SERVE_CONFIG"] == f"{tmp_path}/repo/deploy/config/serve.yaml"
    assert gateway.env["NOTE"] == "/configs/x"  # another path that merely starts alike

    # `run SERVICE ARGS`: the entrypoint stays, the args replace the command
    importer = run("importer", ["OWNER/NAME", "--name", "x"])
    assert importer.argv == ["lorastack", "model", "import", "OWNER/NAME", "--name", "x"]
    assert importer.env == {"HF_ENDPOINT": "http://127.0.0.1:18088"}  # the host's own port


def test_mounted_config_paths_can_point_at_a_mapped_copy(tmp_path: Path) -> None:
    images, where = layout(tmp_path)
    copy = tmp_path / "work" / "mounts" / "gateway" / "config"
    moved = mapping.Layout(where.repo, where.render_root, where.work, where.ports,
                           {"gateway": {"/config": copy}})  # fmt: skip
    gateway = mapping.process_for("gateway", SERVICES, images, moved)
    assert gateway.env["LORASTACK_SERVE_CONFIG"] == f"{copy}/serve.yaml"
