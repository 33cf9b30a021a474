"""The README's "On a GPU host" walk, run for real on the CPU override (`make test-compose`).

    docker-compose -p lorastack-citest -f compose.yaml -f deploy/compose.cpu.yaml \\
        -f deploy/tests/compose.standins.yaml ...

Our four images are built from their Dockerfiles beforehand (deploy/tests/build-images.sh).
Stand-ins, because no registry image can be pulled on the CI machine
(deploy/tests/standins/build.sh): moto's S3 server for MinIO, boto3 for minio/mc,
Debian's prometheus package for prom/prometheus, a Debian bookworm Python for
python:3.11-slim; Grafana is not started (no image), its dashboard's queries are run
against the real Prometheus instead. The model hub is lorastack_testing.fake_hub on the host,
serving SmolLM2-135M-Instruct (converted from the GGUF on PyPI) under its hub repo id.
Once everything is up it also plays the attacker: from a job container and from a container
on vLLM's internal network it tries vLLM's completions, load_lora_adapter and the
supervisor's /admin without keys (docs/security.md).

Not a part of `make test` (testpaths): it needs Docker and ~10 minutes of 2 cores.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from dashboard_queries import dashboard_exprs

from lorastack_testing.fake_hub import FakeHub
from lorastack_testing.net import free_port

REPO = Path(__file__).resolve().parents[2]
PROJECT = "lorastack-citest"
FILES = ["compose.yaml", "deploy/compose.cpu.yaml", "deploy/tests/compose.standins.yaml"]
# keys as the README has users make them (the services refuse short or placeholder keys)
API_KEY = secrets.token_urlsafe(32)
VLLM_KEY = secrets.token_urlsafe(32)
HUB_TOKEN = "hf_citest"
REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TRAIN_STEPS = 2  # enough for a checkpoint, a validation pass and a published adapter
PROBES = 2  # merge verification conversations (default 8): CI time, the check is the same
SERVICES = ("minio", "inference", "gateway", "prometheus")  # with healthchecks
INTERNAL_NETWORK = f"{PROJECT}_inference"  # compose.yaml's `inference` network
# Run inside a container: every way to vLLM an attacker would try, with no key (or a wrong
# one); prints {probe: HTTP status or "unreachable: why"}.
PROBE = """
import json, urllib.request, urllib.error
probes = {
    "completions": ("http://inference:8000/v1/completions",
                    {"model": "smollm2", "prompt": "hi", "max_tokens": 1}, {}),
    "completions, wrong key": ("http://inference:8000/v1/completions",
                    {"model": "smollm2", "prompt": "hi", "max_tokens": 1},
                    {"Authorization": "Bearer not-the-key"}),
    "load_lora_adapter": ("http://inference:8000/v1/load_lora_adapter",
                    {"lora_name": "planted", "lora_path": "/data/lorastack"}, {}),
    "admin": ("http://inference:8001/admin/adapters", {"ref": "chat/adapter:1"}, {}),
    "metrics": ("http://inference:8000/metrics", None, {}),
}
out = {}
for name, (url, body, headers) in probes.items():
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            out[name] = r.status
    except urllib.error.HTTPError as e:
        out[name] = e.code
    except OSError as e:
        out[name] = "unreachable: " + type(e).__name__ + ": " + str(e)[:80]
print("PROBE " + json.dumps(out))
"""

pytestmark = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no Docker")


def prometheus_value(prometheus: str, query: str, timeout_s: float = 120) -> float:
    """The value of an instant query, asked until it has one (a scrape every 5 s)."""
    deadline = time.monotonic() + timeout_s
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    while True:
        with urllib.request.urlopen(url, timeout=10) as resp:
            result = json.load(resp)["data"]["result"]
        if result:
            say(f"  {query} = {result[0]['value'][1]}")
            return float(result[0]["value"][1])
        assert time.monotonic() < deadline, f"Prometheus has no {query}"
        time.sleep(5)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Compose:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.base = ["docker-compose", "-p", PROJECT, "--env-file", ".env.example"]
        for f in FILES:
            self.base += ["-f", f]

    def __call__(
        self, *args: str, stdin: bytes | None = None, check: bool = True, quiet: bool = False
    ) -> subprocess.CompletedProcess[str]:
        start = time.monotonic()
        if not quiet:
            say("$ docker-compose " + " ".join(args))
        r = subprocess.run(
            [*self.base, *args], cwd=REPO, env=self.env, capture_output=True,
            input=stdin.decode() if stdin is not None else None, text=True,
        )  # fmt: skip
        if not quiet:
            tail = (r.stdout + r.stderr).strip().splitlines()[-12:]
            say(
                f"  rc={r.returncode} in {time.monotonic() - start:.0f} s\n    "
                + "\n    ".join(tail)
            )
        if check and r.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r

    def container(self, service: str) -> str:
        return self("ps", "-q", service, quiet=True).stdout.strip()

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        status: dict[str, str] = {}
        while time.monotonic() < deadline:
            for s in services:
                status[s] = _health(self.container(s))
            if all(v == "healthy" for v in status.values()):
                say("healthy: " + ", ".join(services))
                return
            time.sleep(5)
        logs = self("logs", "--tail", "60", *services, check=False, quiet=True)
        raise AssertionError(f"not healthy in {timeout_s:.0f} s: {status}\n{logs.stdout}")


def probe_result(output: str) -> dict[str, object]:
    line = next(ln for ln in output.splitlines() if ln.startswith("PROBE "))
    result: dict[str, object] = json.loads(line.removeprefix("PROBE "))
    return result


def _health(container: str) -> str:
    if not container:
        return "absent"
    fmt = "{{.State.Health.Status}}"
    r = subprocess.run(["docker", "inspect", "-f", fmt, container], capture_output=True, text=True)
    return r.stdout.strip()


@pytest.fixture(scope="module")
def hub(embedded_model: Path) -> Iterator[FakeHub]:
    """SmolLM2 under its hub repo id, gated by a token, reachable from the containers."""
    with FakeHub(host="0.0.0.0") as server:
        server.add(REPO_ID, embedded_model, token=HUB_TOKEN)
        yield server


@pytest.fixture(scope="module")
def compose(hub: FakeHub) -> Iterator[Compose]:
    ports = {p: str(free_port()) for p in ("GATEWAY_PORT", "PROMETHEUS_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "HF_"))}
    env |= ports | {
        "MINIO_CONSOLE_PORT": str(free_port()),
        "MINIO_ROOT_USER": "citest",
        "MINIO_ROOT_PASSWORD": "citest-secret",
        "LORASTACK_API_KEYS": API_KEY,
        "LORASTACK_METRICS_KEY": secrets.token_urlsafe(32),
        "LORASTACK_ADMIN_KEY": secrets.token_urlsafe(32),
        "LORASTACK_VLLM_API_KEY": VLLM_KEY,
        "STORE_GATEWAY_PASSWORD": secrets.token_urlsafe(16),
        "STORE_INFERENCE_PASSWORD": secrets.token_urlsafe(16),
        "GRAFANA_ADMIN_PASSWORD": "citest-grafana",
        "HF_TOKEN": HUB_TOKEN,
        "HF_ENDPOINT": f"http://host.docker.internal:{hub.port}",
        "CPU_THREADS": "2",
    }
    c = Compose(env)
    c("down", "-v", "--remove-orphans", check=False)
    try:
        yield c
    finally:
        c("logs", "--tail", "30", check=False)
        c("down", "-v", "--remove-orphans", check=False)
        left = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        assert not left, f"containers left running: {left}"


def test_the_readme_walk_on_the_cpu_override(
    compose: Compose, hub: FakeHub, tmp_path: Path
) -> None:
    from openai import BadRequestError, OpenAI

    # 4. The store, and Prometheus to watch the training run.
    walk_start = time.time()
    compose("up", "-d", "minio", "minio-init", "prometheus")
    compose.wait_healthy(("minio",), 120)

    # 5. A base model from the (test's) hub, gated: HF_TOKEN reaches the container.
    r = compose(
        "--profile", "import", "run", "--rm", "model-import",
        REPO_ID, "--name", "smollm2-135m-instruct",
    )  # fmt: skip
    assert json.loads(r.stdout[r.stdout.index("{") :])["name"] == "smollm2-135m-instruct"
    assert any(p.endswith("model.safetensors") for _, p, _ in hub.requests)

    # 6. The data, piped in from the host (the demo task, made here).
    demo = tmp_path / "chats.jsonl"
    subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "data", "make-demo", str(demo)], check=True,
        capture_output=True,
    )  # fmt: skip
    compose(
        "--profile", "train", "run", "--rm", "-T", "trainer", "sh", "-c",
        "mkdir -p /data/lorastack/data && cat > /data/lorastack/data/train.jsonl",
        stdin=demo.read_bytes(),
    )  # fmt: skip

    # 7. Check, then a short training run; it publishes chat/adapter.
    compose("--profile", "train", "run", "--rm", "trainer",
            "lorastack", "data", "check", "/config/train.yaml")  # fmt: skip
    steps = f"max_steps={TRAIN_STEPS}"
    every = [f"eval_every={TRAIN_STEPS}", f"checkpoint_every={TRAIN_STEPS}"]
    compose("--profile", "train", "run", "--rm", "--use-aliases", "trainer",
            "lorastack", "train", "/config/train.yaml", steps, *every)  # fmt: skip

    # 8. Merge, verified against base + adapter; it publishes chat/merged.
    compose("--profile", "merge", "run", "--rm", "merger",
            "lorastack", "merge", "chat/adapter", "--probes", str(PROBES))  # fmt: skip
    ls = compose("--profile", "train", "run", "--rm", "trainer", "lorastack", "store", "ls")
    for ref in ("smollm2-135m-instruct:1", "chat/adapter:1", "chat/merged:1"):
        assert ref in ls.stdout, ls.stdout

    # 9. Serve base + adapter; everything healthy.
    compose("up", "-d")
    compose.wait_healthy(SERVICES, 900)

    # 10. Chat and stream through the gateway with the openai client; 400 when too long.
    gateway = f"http://127.0.0.1:{compose.env['GATEWAY_PORT']}/v1"
    client = OpenAI(base_url=gateway, api_key=API_KEY, max_retries=0, timeout=120)
    # the adapter is loaded once its parity check passed, just before inference says
    # ready; the gateway lists it at its next scrape of vLLM (scrape_interval_s, 2 s)
    deadline = time.monotonic() + 30
    while not {"smollm2", "chat/adapter-v1"} <= (
        models := {m.id for m in client.models.list().data}
    ):
        assert time.monotonic() < deadline, models
        time.sleep(0.5)
    ask = [{"role": "user", "content": "Convert to an ISO date: March 3, 2021"}]
    for _ in range(3):  # a few requests, so every rate() of the dashboard has something
        reply = client.chat.completions.create(model="chat/adapter-v1", messages=ask, max_tokens=16)
        answer = reply.choices[0].message.content or ""
        say(f"chat/adapter-v1: {answer!r}")
        assert answer.strip() and reply.usage is not None and reply.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model="smollm2", messages=ask, max_tokens=16, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        say(f"smollm2 (stream): {text!r}")
        assert text.strip()
        time.sleep(6)  # a Prometheus scrape (every 5 s) between rounds
    # vLLM only through the gateway. A job container (the default network, as any other
    # container there) cannot even resolve it; one on the internal network (as a compromised
    # Prometheus or store would be) gets 401 without vLLM's key on completions and on
    # load_lora_adapter, and /admin wants the admin key; only /metrics (the scrape) answers.
    r = compose("--profile", "train", "run", "--rm", "-T", "trainer", "python3", "-c", PROBE)
    outside = probe_result(r.stdout)
    say(f"from a job container: {outside}")
    assert all(str(v).startswith("unreachable") for v in outside.values()), outside
    inside = subprocess.run(
        ["docker", "run", "--rm", "--network", INTERNAL_NETWORK, "--entrypoint", "python3",
         "lorastack/trainer:0.1.0", "-c", PROBE],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    beside = probe_result(inside.stdout)
    say(f"from a container on the inference network: {beside}")
    assert beside == {
        "completions": 401, "completions, wrong key": 401, "load_lora_adapter": 401,
        "admin": 401, "metrics": 200,
    }, beside  # fmt: skip
    assert "planted" not in {m.id for m in client.models.list().data}
    # the gateway's /metrics on its published port: nothing without the metrics key (the
    # dashboard's gateway panels below show that Prometheus, which has it, scrapes it)
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}):
        req = urllib.request.Request(gateway.removesuffix("/v1") + "/metrics", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as scrape:
            urllib.request.urlopen(req, timeout=10)
        assert scrape.value.code == 401 and b"lorastack_gateway_" not in scrape.value.read()

    too_long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="chat/adapter-v1", messages=too_long, max_tokens=8)
    assert refused.value.status_code == 400
    say(f"over-long: 400 {refused.value.message[:160]}")

    # 11. Every query of the Grafana dashboard answers with data from Prometheus, over the
    # walk's time range as a Grafana panel asks (the training row's run ended minutes ago).
    # Asked until every query has data (Prometheus scrapes every 5 s; a fixed 12 s sleep
    # "two more scrapes after the last request" could end first on a loaded machine).
    prometheus = f"http://127.0.0.1:{compose.env['PROMETHEUS_PORT']}"
    deadline = time.monotonic() + 180
    while True:
        found: dict[str, int] = {}
        for expr in dashboard_exprs():
            query = expr.replace("$__rate_interval", "1m")
            span = {"start": f"{walk_start:.0f}", "end": f"{time.time():.0f}", "step": "5"}
            url = f"{prometheus}/api/v1/query_range?" + urllib.parse.urlencode(
                {"query": query, **span}
            )
            with urllib.request.urlopen(url, timeout=10) as resp:
                found[query] = len(json.load(resp)["data"]["result"])
        empty = [query for query, n in found.items() if not n]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(5)
    for query, n in found.items():
        say(f"  {n} series  {query}")
    assert not empty, f"dashboard queries without data: {empty}"
    # what is served is what was trained: the supervisor's parity verdict on the adapter,
    # as Prometheus (and its alert ServedModelDiffersFromTrained) sees it
    parity = 'lorastack_inference_parity_ok{model="chat/adapter-v1"}'
    assert prometheus_value(prometheus, parity) == 1.0

    # 12. The merged model instead of base + adapter.
    compose.env["SERVE_CONFIG"] = "serve-merged.yaml"
    compose("up", "-d", "inference")
    time.sleep(5)
    compose.wait_healthy(("inference", "gateway"), 900)
    deadline = time.monotonic() + 60
    while "chat-merged" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the gateway never listed chat-merged"
        time.sleep(2)
    reply = client.chat.completions.create(model="chat-merged", messages=ask, max_tokens=16)
    say(f"chat-merged: {reply.choices[0].message.content!r}")
    assert (reply.choices[0].message.content or "").strip()
    assert prometheus_value(prometheus, 'lorastack_inference_parity_ok{model="chat-merged"}') == 1.0
