"""The configs embedded in deploy/k8s read together, and who may do what there: the
gateway's tokenizers and Redis, Prometheus's key, Pod Security "restricted", the
NetworkPolicies, one Secret per workload, and checkov's Kubernetes checks.

Everything is rendered by `kubectl kustomize` (tests/k8s_render.py), with the values a user
writes from deploy/k8s/secrets.example. Where a test needs a service's view of a container,
its command line goes through the real `lorastack` parser and its environment (ConfigMap +
Secret + env, `$(VAR)` expanded as the kubelet does) into the service's settings class.
Each container's own check mode, run as a process of its own, is test_k8s_containers.py's;
schema checks (kubernetes_validate) live in test_deploy.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from k8s_render import (
    K8S,
    KINDS,
    MONITORING,
    PLACEHOLDER,
    TARGETS,
    Pod,
    checkov,
    kustomize,
    render,
    render_copy,
    rendered_text,
    runs_lorastack,
    secret_data,
)

from lorastack_testing.net import free_port
from lorastack_testing.redis_server import redis_binary, require_redis_server

REPO = Path(__file__).resolve().parents[1]
FOLDERS = TARGETS
MINIO = "deploy/k8s/overlays/minio"


def pods(folder: str, root: Path) -> list[Pod]:
    """The workloads that run a lorastack service (not the Redis of the gateways' limits)."""
    docs = render(folder)
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
    """LORASTACK_REDIS_URL names the Service and port of the Redis Deployment, and Debian's
    redis-server, started with the manifest's args (its password from the redis Secret),
    refuses a client without the password and answers the gateway's URL."""
    import redis as redis_client

    docs = render(FOLDERS[0])
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
    redis_pod = Pod(docs, redis, tmp_path / "redis-pod")
    assert redis_pod.args[0] == "redis-server"
    assert url.password and url.password == redis_pod.env["REDIS_PASSWORD"]
    assert redis_pod.args[redis_pod.args.index("--protected-mode") + 1] == "yes"
    require_redis_server()
    with _redis_server(redis_pod.args[1:]) as (local_port, refused):
        assert refused.startswith(b"-NOAUTH"), refused  # no password, no PING
        local = url._replace(netloc=f":{url.password}@127.0.0.1:{local_port}").geturl()
        assert redis_client.Redis.from_url(local, socket_timeout=10).ping()


def test_prometheus_scrapes_the_gateway_with_its_metrics_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's /metrics answers only its metrics key (auth is on): its settings hold
    one, and the monitoring target gives Prometheus, in its own namespace, the same key as
    a Secret and the scrape jobs whose gateway job sends the file that Secret mounts as
    (the Prometheus Operator's /etc/prometheus/secrets/NAME/KEY)."""
    docs = render(FOLDERS[0])
    (pod,) = [p for p in pods(FOLDERS[0], tmp_path) if p.lorastack_argv()[0] == "gateway"]
    with monkeypatch.context() as m:
        gateway = check_gateway(parse(pod, m))
    assert gateway.auth_required and gateway.metrics_key is not None
    assert "gateway-metrics" in {re.sub(r"-[a-z0-9]{10}$", "", s) for s in pod.secrets}
    monitoring = {(d["kind"], d["metadata"]["name"]): d for d in render(MONITORING)}
    assert {d["metadata"]["namespace"] for d in monitoring.values()} == {"monitoring"}
    scrape = secret_data(monitoring[("Secret", "lorastack-scrape-configs")])
    jobs = yaml.safe_load(scrape["scrape-configs.yaml"])
    (job,) = [j for j in jobs if j["job_name"] == "gateway"]
    assert job["authorization"]["type"] == "Bearer"
    key_file = Path(job["authorization"]["credentials_file"])
    assert key_file.parent == Path("/etc/prometheus/secrets/lorastack-gateway-metrics")
    key_secret = secret_data(monitoring[("Secret", key_file.parent.name)])
    assert key_secret[key_file.name] == gateway.metrics_key.get_secret_value()
    gateway_tpl = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway"
    )
    annotations = gateway_tpl["spec"]["template"]["metadata"].get("annotations", {})
    assert "prometheus.io/scrape" not in annotations  # such a scrape could not send the key


def test_prometheus_loads_the_alert_rules_compose_loads() -> None:
    """The rules of deploy/prometheus/rules.yml (GatewayLimitsNotShared, ...) reach the
    cluster's Prometheus as the monitoring target's ConfigMap, unchanged."""
    monitoring = {d["metadata"]["name"]: d for d in render(MONITORING)}
    rules = monitoring["lorastack-prometheus-rules"]["data"]["rules.yml"]
    assert rules == (REPO / "deploy/prometheus/rules.yml").read_text()
    alerts = {r.get("alert") for g in yaml.safe_load(rules)["groups"] for r in g["rules"]}
    assert {"GatewayLimitsNotShared", "ServedModelDiffersFromTrained"} <= alerts


def test_the_prometheus_operator_loads_the_alert_rules_as_a_prometheus_rule(
    tmp_path: Path,
) -> None:
    """The Operator loads rules only from PrometheusRules (it writes rule_files itself):
    deploy/k8s/monitoring-operator is the monitoring target plus one, whose groups are
    deploy/prometheus/rules.yml's, in the same namespace."""
    docs = render_copy("deploy/k8s/monitoring-operator", tmp_path)
    made = {(d["kind"], d["metadata"]["name"]) for d in docs}
    shipped = {(d["kind"], d["metadata"]["name"]) for d in render(MONITORING)}
    assert made == shipped | {("PrometheusRule", "lorastack")}
    assert {d["metadata"]["namespace"] for d in docs} == {"monitoring"}
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = yaml.safe_load((REPO / "deploy/prometheus/rules.yml").read_text())
    assert rule["spec"] == {"groups": rules["groups"]}
    alerts = {r.get("alert") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"GatewayLimitsNotShared", "ServedModelDiffersFromTrained"} <= alerts


class _redis_server:
    """redis-server with `args` on a free loopback port; yields (port, the answer to a PING
    without the password). Ready when it answers at all (NOAUTH is an answer)."""

    def __init__(self, args: list[str]) -> None:
        self.args = args

    def __enter__(self) -> tuple[int, bytes]:
        self.dir = tempfile.TemporaryDirectory(prefix="lorastack-redis-")
        port = free_port()
        binary = redis_binary()
        assert binary is not None
        cmd = [
            binary,
            *self.args,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir.name,
        ]
        self.log = open(f"{self.dir.name}/redis.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(750):  # 15 s at 20 ms: it starts in milliseconds on an idle machine
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    answer = s.recv(64)
                if answer:
                    return port, answer
            except OSError:
                pass
            time.sleep(0.02)
        self.__exit__()
        raise AssertionError(f"redis-server did not start: {cmd}")

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        self.dir.cleanup()


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


# -- who may do what -------------------------------------------------------------------

WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "CronJob"}


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOADS]


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_pod_meets_pod_security_restricted(folder: str) -> None:
    """The Pod Security Standard "restricted" (its checks, as the admission controller makes
    them), plus no service account token and a read-only root filesystem."""
    found = workloads(render(folder))
    assert {d["metadata"]["name"] for d in found} >= {"gateway", "inference", "redis", "trainer"}
    for w in found:
        name, spec = w["metadata"]["name"], w["spec"]["template"]["spec"]
        assert spec.get("automountServiceAccountToken") is False, name
        assert not {"hostNetwork", "hostPID", "hostIPC"} & {k for k, v in spec.items() if v}, name
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], name
        pod_sc = spec.get("securityContext", {})
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = pod_sc | c.get("securityContext", {})  # the container's wins
            where = f"{name}/{c['name']}"
            assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 1) != 0, where
            assert sc.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), (
                where
            )
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert not sc.get("privileged"), where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            # what it writes has a volume: /tmp everywhere, the home of lorastack's services
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts or c["name"] == "redis", (where, mounts)


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_namespace_enforces_pod_security_restricted(folder: str) -> None:
    """What the pods meet (above), the Namespace enforces: Pod Security admission refuses
    a pod that breaks "restricted", and audits and warns about it, at a pinned version."""
    docs = render(folder)
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    labels = namespace["metadata"].get("labels", {})
    for mode in ("enforce", "audit", "warn"):
        assert labels.get(f"pod-security.kubernetes.io/{mode}") == "restricted", (mode, labels)
        version = labels.get(f"pod-security.kubernetes.io/{mode}-version", "")
        assert re.fullmatch(r"v1\.\d+", version), (mode, version)  # pinned, not `latest`
    # every workload lands in it
    assert {d["metadata"].get("namespace") for d in workloads(docs)} == {
        namespace["metadata"]["name"]
    }


def _admits(
    policies: list[dict[str, Any]], source: dict[str, str], source_ns: str,
    target: dict[str, str], port: int,
) -> bool:  # fmt: skip
    """NetworkPolicy ingress semantics in our namespace: a pod selected by no policy takes
    everything; else some rule of a selecting policy must match the source and the port."""
    selecting = [p for p in policies if _labels_match(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress") or []:
            ports = [q["port"] for q in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get("from")
            if peers is None:
                return True  # no `from`: every source
            for peer in peers:
                ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
                ns_ok = (
                    _labels_match(ns_sel, {"kubernetes.io/metadata.name": source_ns})
                    if ns_sel is not None
                    else source_ns == "lorastack"
                )
                if ns_ok and (pod_sel is None or _labels_match(pod_sel, source)):
                    return True
    return False


def _labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


GATEWAY, INFERENCE, REDIS, TRAINER = (
    {"app": a} for a in ("gateway", "inference", "redis", "trainer")
)
STORE, OTHER = {"app": "minio"}, {"app": "something-else"}
IMPORT, STORE_INIT = {"app": "model-import"}, {"app": "store-init"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


@pytest.mark.parametrize(
    ("source", "source_ns", "target", "port", "admitted"),
    [
        (GATEWAY, "lorastack", INFERENCE, 8000, True),
        (GATEWAY, "lorastack", INFERENCE, 8001, True),
        (PROMETHEUS, "monitoring", INFERENCE, 8000, True),
        (PROMETHEUS, "monitoring", INFERENCE, 8001, True),
        (TRAINER, "lorastack", INFERENCE, 8000, False),  # a job cannot use vLLM's port
        (REDIS, "lorastack", INFERENCE, 8000, False),
        (OTHER, "lorastack", INFERENCE, 8000, False),
        (OTHER, "lorastack", INFERENCE, 8001, False),  # nor the supervisor's /admin
        (GATEWAY, "default", INFERENCE, 8000, False),  # same labels, another namespace
        (PROMETHEUS, "lorastack", INFERENCE, 8000, False),  # not the monitoring namespace
        (GATEWAY, "lorastack", REDIS, 6379, True),
        (INFERENCE, "lorastack", REDIS, 6379, False),
        (TRAINER, "lorastack", REDIS, 6379, False),
        (OTHER, "elsewhere", GATEWAY, 8080, True),  # the public entry
        (OTHER, "elsewhere", GATEWAY, 9000, False),
        (GATEWAY, "lorastack", STORE, 9000, True),
        (INFERENCE, "lorastack", STORE, 9000, True),
        (TRAINER, "lorastack", STORE, 9000, True),
        (IMPORT, "lorastack", STORE, 9000, True),
        (STORE_INIT, "lorastack", STORE, 9000, True),
        (STORE_INIT, "lorastack", INFERENCE, 8000, False),
        (IMPORT, "lorastack", REDIS, 6379, False),
        (REDIS, "lorastack", STORE, 9000, False),
        (OTHER, "lorastack", STORE, 9000, False),
        (OTHER, "lorastack", TRAINER, 9400, False),
    ],
)
def test_network_policies_admit_only_who_needs_it(
    source: dict[str, str], source_ns: str, target: dict[str, str], port: int, admitted: bool
) -> None:
    policies = [d for d in render(MINIO) if d["kind"] == "NetworkPolicy"]
    assert _admits(policies, source, source_ns, target, port) is admitted


def test_every_pod_is_covered_by_a_deny_by_default_policy() -> None:
    docs = render(FOLDERS[0])
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    deny_all = [
        p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
    ]
    assert deny_all and deny_all[0]["spec"]["policyTypes"] == ["Ingress"]


# what each workload may read: its own Secret, and the shared keys it needs, nothing more
SECRETS_OF = {
    "gateway": {"gateway", "vllm-api-key", "redis", "gateway-metrics"},
    "inference": {"inference", "vllm-api-key"},
    "trainer": {"trainer"},
    "model-import": {"trainer"},  # the store user that publishes
    "merger": {"trainer"},
    "redis": {"redis"},
    "minio": {"minio"},  # its root user, which only it and store-init see
    "store-init": {"minio", "gateway", "inference", "trainer"},  # makes their store users
}


@pytest.mark.parametrize("folder", FOLDERS)
def test_one_secret_per_workload_and_least_privilege(folder: str, tmp_path: Path) -> None:
    docs = render(folder)
    generated = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    base_name = {re.sub(r"-[a-z0-9]{10}$", "", n): n for n in generated}  # kustomize's hash
    assert set(base_name) == set().union(*SECRETS_OF.values()) - (
        set() if folder == MINIO else {"minio"}
    )
    for w in workloads(docs):
        pod = Pod(docs, w, tmp_path / folder.replace("/", "_"))
        reads = {re.sub(r"-[a-z0-9]{10}$", "", s) for s in pod.secrets}
        assert reads == SECRETS_OF[w["metadata"]["name"]], w["metadata"]["name"]
    gateway = secret_data(generated[base_name["gateway"]])
    assert "LORASTACK_ADMIN_KEY" not in gateway  # the gateway never loads adapters
    trainer = secret_data(generated[base_name["trainer"]])
    assert not [k for k in trainer if "API_KEY" in k or "ADMIN" in k]


def test_the_base_holds_no_secret_value_and_renders_only_with_the_users_files(
    tmp_path: Path,
) -> None:
    """No Secret is committed: kustomize stops, naming the file to write, until the user
    has written deploy/k8s/base/secrets/ (ignored by git); the examples are placeholders."""
    for f in (K8S / "base").glob("*.yaml"):
        kinds = {d.get("kind") for d in yaml.safe_load_all(f.read_text()) if d}
        assert "Secret" not in kinds, f
    copy = tmp_path / "k8s"
    import shutil

    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets"))
    r = kustomize(copy / "base")
    assert r.returncode != 0 and "secrets/gateway.env" in r.stderr, r.stderr
    for example in (K8S / "secrets.example").glob("*.env"):
        for line in example.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                assert PLACEHOLDER.search(line.split("=", 1)[1]), (example.name, line)
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/k8s/base/secrets/gateway.env"], cwd=REPO
    )  # fmt: skip
    assert ignored.returncode == 0, "deploy/k8s/base/secrets/ must be in .gitignore"


def test_the_example_placeholders_are_refused_by_the_services(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user who copies an example without editing it gets a start error, not a key that
    every reader of this repository knows."""
    from inference.settings import build_settings
    from lorastack.errors import ConfigError

    example = (K8S / "secrets.example/vllm-api-key.env").read_text()
    value = re.search(r"^LORASTACK_VLLM_API_KEY=(.*)$", example, flags=re.M)
    assert value is not None
    clear_lorastack_env(monkeypatch)
    with pytest.raises(ConfigError, match="vllm_api_key"):
        build_settings(model="m", vllm_api_key=value[1])
    # the gateway's copy of the vLLM key, and Redis's password inside its URL
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    password = re.search(
        r"^REDIS_PASSWORD=(.*)$", (K8S / "secrets.example/redis.env").read_text(), flags=re.M
    )
    assert password is not None
    for values, says in [
        ({"vllm_api_key": value[1]}, "vllm_api_key is the placeholder"),
        ({"redis_url": f"redis://:{password[1]}@redis:6379/0"}, "redis_url's password is the placeholder"),
    ]:  # fmt: skip
        with pytest.raises(ValidationError, match=says):
            GatewaySettings(**values)


# checkov's Kubernetes checks on what `kubectl kustomize` renders; each skip says why
CHECKOV_SKIPS = {
    # CPU limits throttle (CFS quota) the latency of serving and the step time of training;
    # CPU requests reserve the cores, memory has limits
    "CKV_K8S_11": "CPU limits",
    # our images are built and pushed by the user; pin digests at deploy time
    # (`kustomize edit set image`); the public Redis image is pinned to a patch release
    "CKV_K8S_43": "image digests",
    # with versioned tags (0.1.0, 8.10.2) IfNotPresent is the same image without a registry
    # round trip on every restart
    "CKV_K8S_15": "imagePullPolicy Always",
    # the services read their settings from LORASTACK_* variables (one settings class each);
    # each Secret is a workload's own, so no other pod sees them
    "CKV_K8S_35": "secrets as files",
}


def test_checkov_kubernetes_checks_pass_on_the_rendered_manifests(tmp_path: Path) -> None:
    manifests = tmp_path / "rendered.yaml"
    manifests.write_text(rendered_text())
    r = subprocess.run(
        [checkov(), "--framework", "kubernetes", "--file", str(manifests), "--quiet",
         "--compact", "--output", "json", "--skip-download",
         "--skip-check", ",".join(CHECKOV_SKIPS)],
        capture_output=True, text=True, check=False,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},  # no call home: the tests are offline
    )  # fmt: skip
    report = json.loads(r.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [
        f"{c['check_id']} {c['resource']}: {c['check_name']}"
        for rep in reports
        for c in rep.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "\n".join(failed)
    assert sum(rep["summary"]["passed"] for rep in reports) > 100, r.stdout[-2000:]


def test_a_missing_kubectl_under_ci_fails_rather_than_skips(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where CI is set, a machine without kubectl fails every k8s test. Caught as any
    outcome (a skip is not a failure to pytest.raises(pytest.fail.Exception): a tool()
    that went back to skipping would make that test skip, not fail)."""
    from k8s_render import tool

    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without kubectl
    monkeypatch.setenv("CI", "true")
    outcome: BaseException | None = None
    try:
        tool("kubectl", tmp_path / "kubectl")  # nor one in .venv
    except BaseException as e:  # pytest's skip and fail are BaseExceptions
        outcome = e
    assert isinstance(outcome, pytest.fail.Exception), repr(outcome)


def test_the_minio_component_makes_the_store_users_the_workloads_secrets_name() -> None:
    """store-init makes one MinIO user per workload from that workload's own Secret (the
    access key and secret the service reads), with compose's policies, and the base's
    store endpoint becomes the component's Service."""
    docs = render(MINIO)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    secret_names = {re.sub(r"-[a-z0-9]{10}$", "", n): n for k, n in by_name if k == "Secret"}
    (init,) = by_name[("Job", "store-init")]["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"] if "valueFrom" in e}
    for workload in ("gateway", "inference", "trainer"):
        for var, key in (("USER", "ACCESS_KEY_ID"), ("SECRET", "SECRET_ACCESS_KEY")):
            ref = refs[f"{workload.upper()}_{var}"]
            assert ref == {"name": secret_names[workload], "key": f"LORASTACK_S3_{key}"}
            assert f'"${workload.upper()}_{var}"' in init["args"][0]
    policies = next(d for k, d in by_name.items() if k[0] == "ConfigMap" and "minio-pol" in k[1])
    assert json.loads(policies["data"]["inference-policy.json"]) == json.loads(
        (REPO / "deploy/minio/inference-policy.json").read_text()
    )
    settings = by_name[("ConfigMap", "lorastack-settings")]["data"]
    service = by_name[("Service", "minio")]["spec"]
    url = urlsplit(settings["LORASTACK_S3_ENDPOINT_URL"])
    assert url.hostname == "minio" and url.port in [p["port"] for p in service["ports"]]
    for folder in ("components/minio/secrets", "monitoring/secrets"):
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", f"deploy/k8s/{folder}/x.env"], cwd=REPO
        )
        assert ignored.returncode == 0, f"deploy/k8s/{folder}/ must be in .gitignore"


@pytest.mark.parametrize("folder", FOLDERS)
def test_jobs_that_need_the_store_filled_wait_to_be_started(folder: str) -> None:
    """`kubectl apply` starts the model import at once; the trainer (it needs the base
    model and the dataset) and the merger (the adapter) are suspended until started, so
    that none spends its backoffLimit on what is not there yet."""
    jobs = {d["metadata"]["name"]: d["spec"] for d in render(folder) if d["kind"] == "Job"}
    assert jobs["trainer"].get("suspend") is True and jobs["merger"].get("suspend") is True
    assert not jobs["model-import"].get("suspend")


def _k8s_docs() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## On Kubernetes") :]
    scaling = (REPO / "docs/scaling.md").read_text()
    return section[: section.index("\n## ", 3)] + scaling


def test_the_k8s_docs_name_only_what_the_manifests_make() -> None:
    """README's "On Kubernetes" and docs/scaling.md: every deploy/k8s path they name is in
    the repository (or is a secrets folder the user writes, ignored by git), every object
    they name (`job/X`, `svc/X`, `patch job X`, ...) is rendered by the base or the MinIO
    overlay, and every make target they name exists."""
    text = _k8s_docs()
    for path in set(re.findall(r"deploy/k8s/[\w./-]*\w", text)):
        if not (REPO / path).exists():
            ignored = subprocess.run(["git", "check-ignore", "-q", f"{path}/x.env"], cwd=REPO)
            assert ignored.returncode == 0 and "secrets" in path, f"{path}: no such file"
    made = {(d["kind"].lower(), d["metadata"]["name"]) for d in render(MINIO)}
    short = {
        "svc": "service",
        "job": "job",
        "statefulset": "statefulset",
        "deployment": "deployment",
    }
    named = re.findall(r"\b(svc|job|statefulset|deployment)/([a-z0-9-]+)", text)
    named += re.findall(r"\b(?:patch|delete) (job) ([a-z0-9-]+)", text)
    assert named
    for kind, name in named:
        assert (short[kind], name) in made, f"{kind}/{name} is made by no manifest"
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    commands = re.findall(r"(?:`|^\s*)make ((?:[a-z][\w-]* ?)+)", text, flags=re.M)
    assert commands
    for line in commands:  # `make images push-images REGISTRY=...`: the lowercase words
        assert set(line.split()) <= targets, line
