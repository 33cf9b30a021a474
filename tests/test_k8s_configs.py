"""The configs embedded in deploy/k8s, validated by the classes the services build at start.

Each container's command line goes through the real `lorastack` parser, its environment
(ConfigMap + Secret + env) into the service's settings class, and every file it reads from a
mounted ConfigMap (serve.yaml, train.yaml) through the same loader the service uses. Schema
checks (kubernetes_validate) live in test_deploy.py; these check the contents.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kustomize_lite import render

from lorastack_testing.redis_server import require_redis_server, serve_redis

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ["deploy/k8s/base", "deploy/k8s/overlays/multi-gpu-training"]


class Pod:
    """One container as the service would see it: argv, environment, mounted files."""

    def __init__(self, docs: list[dict[str, Any]], workload: dict[str, Any], root: Path) -> None:
        by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        self.args: list[str] = container["args"]
        self.env: dict[str, str] = {}
        for src in container.get("envFrom", []):
            if "configMapRef" in src:
                data = by_name[("ConfigMap", src["configMapRef"]["name"])]["data"]
            else:
                data = by_name[("Secret", src["secretRef"]["name"])]["stringData"]
            self.env |= {k: v for k, v in data.items() if k.isupper()}  # files are not env
        self.env |= {e["name"]: e["value"] for e in container.get("env", [])}
        self.mounts: dict[str, Path] = {}  # mountPath -> folder here holding its files
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):
            folder = root / workload["metadata"]["name"] / m["name"]
            folder.mkdir(parents=True)
            cm = volumes.get(m["name"], {}).get("configMap")  # else a claim or emptyDir
            if cm is not None:
                data = by_name[("ConfigMap", cm["name"])]["data"]
                items = cm.get("items") or [{"key": k, "path": k} for k in data]
                for it in items:
                    (folder / it["path"]).write_text(data[it["key"]])
            self.mounts[m["mountPath"]] = folder

    def local(self, path: str) -> str:
        """A path inside the container -> the file written here (or unchanged)."""
        for mount, folder in self.mounts.items():
            if path.startswith(mount + "/"):
                return str(folder / path.removeprefix(mount + "/"))
        return path

    def lorastack_argv(self) -> list[str]:
        """The arguments after `lorastack` (also through `torchrun ... -m lorastack.cli`)."""
        if self.args[0] == "lorastack":
            return self.args[1:]
        assert self.args[0] == "torchrun", self.args
        i = self.args.index("-m")
        assert self.args[i + 1] == "lorastack.cli", self.args
        return self.args[i + 2 :]


KINDS = {"Deployment", "StatefulSet", "Job"}


def runs_lorastack(workload: dict[str, Any]) -> bool:
    args = workload["spec"]["template"]["spec"]["containers"][0].get("args", [""])
    return args[0] in ("lorastack", "torchrun")


def pods(folder: str, root: Path) -> list[Pod]:
    """The workloads that run a lorastack service (not the Redis of the gateways' limits)."""
    docs = render(REPO / folder)
    at = root / folder.replace("/", "_")
    return [Pod(docs, d, at) for d in docs if d["kind"] in KINDS and runs_lorastack(d)]


def clear_lorastack_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what the manifest gives: none of this process's own LORASTACK_* settings."""
    for k in [k for k in os.environ if k.startswith("LORASTACK_")]:
        monkeypatch.delenv(k)


def parse(pod: Pod, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    from lorastack.cli import build_parser

    clear_lorastack_env(monkeypatch)
    for k, v in pod.env.items():
        monkeypatch.setenv(k, pod.local(v))
    return build_parser().parse_args([pod.local(a) for a in pod.lorastack_argv()])


def check_serve(ns: argparse.Namespace) -> Any:
    from inference.main import LOOPBACK
    from inference.settings import load_serve_config

    settings = load_serve_config(Path(ns.config))
    assert settings.admin_key is not None or settings.supervisor_host in LOOPBACK, "/admin off"
    return settings


def check_gateway(ns: argparse.Namespace) -> Any:
    from gateway.settings import GatewaySettings

    return GatewaySettings()


def check_train(ns: argparse.Namespace) -> Any:
    from trainer.config import load_config
    from trainer.settings import TrainerSettings

    TrainerSettings()
    assert ns.resume == "auto", "a Job restarts: --resume auto (a bare --resume refuses run 1)"
    return load_config(Path(ns.config), list(ns.overrides))


CHECKS = {"serve": check_serve, "gateway": check_gateway, "train": check_train}


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_embedded_config_is_valid_for_its_service(
    folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = set()
    for pod in pods(folder, tmp_path):
        command = pod.lorastack_argv()[0]
        with monkeypatch.context() as m:
            CHECKS[command](parse(pod, m))
        seen.add(command)
    assert seen == set(CHECKS)


def test_gateway_takes_the_served_models_tokenizer_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_command = {p.lorastack_argv()[0]: p for p in pods(FOLDERS[0], tmp_path)}
    with monkeypatch.context() as m:
        serve = check_serve(parse(by_command["serve"], m))
    with monkeypatch.context() as m:
        gateway = check_gateway(parse(by_command["gateway"], m))
    # the name clients send (vLLM's) -> the store artifact, not vLLM's local path
    assert gateway.tokenizers == {serve.resolved_served_name: serve.model}
    assert serve.resolved_served_name != serve.model  # the case that used to answer 503


def test_gateway_replicas_share_limits_through_the_manifests_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LORASTACK_REDIS_URL names the Service and port of the Redis Deployment, the network
    policy lets the gateway pods in, and Debian's redis-server takes the manifest's args."""
    docs = render(REPO / FOLDERS[0])
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (pod,) = [p for p in pods(FOLDERS[0], tmp_path) if p.lorastack_argv()[0] == "gateway"]
    with monkeypatch.context() as m:
        gateway = check_gateway(parse(pod, m))
    assert by_name[("Deployment", "gateway")]["spec"]["replicas"] > 1
    assert gateway.redis_url is not None, "replicas without Redis give a key N x its limit"
    url = urlsplit(gateway.redis_url.get_secret_value())
    service = by_name[("Service", url.hostname)]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    others = [d for d in docs if d["kind"] in KINDS and not runs_lorastack(d)]
    (redis,) = [d for d in others if _selects(service["spec"]["selector"], d)]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in [p["containerPort"] for p in container["ports"]]
    policy = by_name[("NetworkPolicy", "redis")]["spec"]
    assert _selects(policy["podSelector"]["matchLabels"], redis)
    (allowed,) = policy["ingress"]
    assert _selects(
        allowed["from"][0]["podSelector"]["matchLabels"], by_name[("Deployment", "gateway")]
    )
    assert allowed["ports"][0]["port"] == port["targetPort"]
    assert container["args"][0] == "redis-server"
    require_redis_server()
    with serve_redis(options=container["args"][1:]):
        pass  # it started with them and answered PING (else RuntimeError with its log)


def _selects(labels: dict[str, str], workload: dict[str, Any]) -> bool:
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(pod_labels.get(k) == v for k, v in labels.items())


def test_a_broken_embedded_config_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorastack.errors import ConfigError

    (pod,) = [p for p in pods(FOLDERS[0], tmp_path) if p.lorastack_argv()[0] == "train"]
    train_yaml = Path(pod.local("/config/train.yaml"))
    train_yaml.write_text("base_model: smollm2-135m-instruct\ndataset: my-run/data\noutput: r\n")
    with monkeypatch.context() as m, pytest.raises(ConfigError, match="dataset"):
        check_train(parse(pod, m))


def test_compose_gives_the_gateway_inferences_serve_config() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    serve_arg = compose["inference"]["command"][-1]
    assert compose["gateway"]["environment"]["LORASTACK_SERVE_CONFIG"] == serve_arg
    mounts = {v.split(":")[0]: v.split(":")[1] for v in compose["gateway"]["volumes"]}
    inference = {v.split(":")[0]: v.split(":")[1] for v in compose["inference"]["volumes"]}
    assert mounts["./deploy/config"] == inference["./deploy/config"] == "/config"
    cpu = yaml.safe_load((REPO / "deploy/compose.cpu.yaml").read_text())["services"]
    assert cpu["gateway"]["volumes"] == cpu["inference"]["volumes"]  # the CPU config folder


def test_resume_auto_starts_a_first_run_and_resumes_a_restarted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorastack.cli import build_parser
    from trainer.cli import _resume
    from trainer.config import build_config
    from trainer.settings import TrainerSettings

    clear_lorastack_env(monkeypatch)
    monkeypatch.setenv("LORASTACK_HOME", str(tmp_path))
    settings = TrainerSettings()
    config = build_config({"dataset": {"path": "chat.jsonl"}, "output": "job"})
    auto = build_parser().parse_args(["train", "t.yaml", "--resume", "auto", "lr=1e-4"])
    assert auto.resume == "auto" and auto.overrides == ["lr=1e-4"]
    assert _resume(auto, config, settings) is False  # first run: start
    (settings.resolved_runs_dir / "job" / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert _resume(auto, config, settings) is True  # a restart: continue

    # the bare flag keeps its meaning, also when an override follows it
    bare = build_parser().parse_args(["train", "t.yaml", "--resume", "lr=1e-4"])
    assert bare.resume is True and bare.overrides == ["lr=1e-4"]
    assert build_parser().parse_args(["train", "t.yaml"]).resume is False
