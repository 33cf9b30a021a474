"""The README's first command, end to end on the embedded defaults, with a very short
training: every stage's artifact exists, the gateway answers, and every Grafana query
names a metric that the live stack's /metrics really exposes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dashboard_queries import missing_from, trainer_metric_names
from prometheus_client.parser import text_string_to_metric_families

from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_app.local_stack import GATEWAY_PORT, SUPERVISOR_PORT, VLLM_PORT

GATEWAY = f"http://127.0.0.1:{GATEWAY_PORT}"


def lorastack(*args: str, home: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
    env |= {"LORASTACK_HOME": str(home), "LORASTACK_TORCH_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "lorastack.cli", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def demo(
    tmp_path_factory: pytest.TempPathFactory, embedded_model: Path
) -> Iterator[tuple[Path, str]]:
    home = tmp_path_factory.mktemp("e2e") / "home"
    # reuse the converted base model instead of converting the GGUF again (~1 min)
    from lorastack.base_model import find_default_gguf
    from lorastack.manifest import sha256_file

    models = home / "models"
    models.mkdir(parents=True)
    sha = sha256_file(find_default_gguf())[:12]
    (models / f"smollm2-135m-instruct-{sha}").symlink_to(embedded_model)
    try:
        out = lorastack("demo", "--max-steps", "4", home=home, timeout=1800)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        print(out.stdout)  # the demo's own report, shown with pytest -s
        yield home, out.stdout
    finally:
        lorastack("down", home=home, timeout=120)


@pytest.mark.slow
def test_every_stage_left_its_artifact(demo: tuple[Path, str]) -> None:
    home, log = demo
    assert "== timings (s)" in log, log[-4000:]
    store = open_store(CommonSettings(home=home))
    kinds = {m.name: m.kind for m in store.ls()}
    assert kinds["smollm2-135m-instruct"] == "base-model"
    assert kinds["date-iso/data"] == kinds["date-iso/test"] == "dataset"
    assert kinds["date-iso/adapter"] == "adapter"
    assert kinds["date-iso/merged"] == "merged-model"
    merged = store.fetch(store.resolve("date-iso/merged"))
    report = json.loads((merged / "merge-report.json").read_text())
    assert report["passed"] is True
    adapter = store.fetch(store.resolve("date-iso/adapter"))
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "training-complete.json").is_file() and (adapter / "loss.png").is_file()
    assert (home / "demo" / "eval" / "report.md").is_file()
    assert "verdict" in (home / "demo" / "eval" / "report.md").read_text().lower()


@pytest.mark.slow
def test_the_gateway_answers_base_and_lora(demo: tuple[Path, str]) -> None:
    models = httpx.get(f"{GATEWAY}/v1/models", timeout=30).json()["data"]
    ids = {m["id"] for m in models}
    assert "smollm2" in ids and any(m.get("parent") for m in models), models
    body = {
        "model": "smollm2",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    r = httpx.post(f"{GATEWAY}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip()


@pytest.mark.slow
def test_every_dashboard_query_matches_the_live_metrics(demo: tuple[Path, str]) -> None:
    exposed: set[str] = set()
    for url in (
        f"{GATEWAY}/metrics",
        f"http://127.0.0.1:{VLLM_PORT}/metrics",
        f"http://127.0.0.1:{SUPERVISOR_PORT}/metrics",
    ):
        text = httpx.get(url, timeout=30).text
        for fam in text_string_to_metric_families(text):
            exposed |= {fam.name} | {s.name for s in fam.samples}
    # the training row's gauges come from a running trainer (test_trainer_live, and the
    # compose walk scrapes one for real), not from the serving stack
    assert missing_from(exposed | trainer_metric_names()) == {}


@pytest.mark.slow
def test_promote_follows_the_demos_verdict_and_the_label_is_served(
    demo: tuple[Path, str],
) -> None:
    home, _ = demo
    store = open_store(CommonSettings(home=home))
    report = store.resolve("date-iso/eval")
    verdict = report.metadata["verdicts"][report.metadata["primary_metric"]]
    out = lorastack("promote", "date-iso/adapter", home=home, timeout=120)
    if verdict == "improvement":
        assert out.returncode == 0, out.stderr
    else:  # 4 training steps rarely beat base + prompt: refused, with the numbers
        assert out.returncode == 3, out.stdout + out.stderr
        assert f"says '{verdict}' on the primary metric" in out.stderr
        assert " CI [" in out.stderr and "n = " in out.stderr
        out = lorastack(
            "promote", "date-iso/adapter", "--force", "--reason", "e2e", home=home, timeout=120
        )
        assert out.returncode == 0, out.stderr
    adapter = store.resolve("date-iso/adapter")
    assert store.resolve("date-iso/adapter@promoted").ref == adapter.ref
    admin = f"http://127.0.0.1:{SUPERVISOR_PORT}/admin/adapters"
    r = httpx.post(admin, json={"ref": "date-iso/adapter@promoted"}, timeout=120)
    assert r.status_code == 201, r.text
    try:
        deadline = time.monotonic() + 30  # the gateway scrapes /v1/models every 2 s
        while "date-iso/adapter-promoted" not in {
            m["id"] for m in httpx.get(f"{GATEWAY}/v1/models", timeout=30).json()["data"]
        }:
            assert time.monotonic() < deadline, "the gateway does not list the promoted adapter"
            time.sleep(0.5)
        body = {
            "model": "date-iso/adapter-promoted",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "the ninth of May, 2013"}],
        }
        r = httpx.post(f"{GATEWAY}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        httpx.delete(admin + "/date-iso/adapter-promoted", timeout=60)


@pytest.mark.slow
def test_vllm_serves_the_verified_merged_model(demo: tuple[Path, str], tmp_path: Path) -> None:
    """The merger's published folder (not a hand-made one) is what vLLM loads and serves."""
    from inference.engine import VllmServer
    from lorastack_testing.net import free_port

    home, _ = demo
    store = open_store(CommonSettings(home=home))
    merged = store.fetch(store.resolve("date-iso/merged"))
    prompt = [{"role": "user", "content": "Convert to ISO 8601: the ninth of May, 2013"}]
    with VllmServer(merged, served_name="merged", port=free_port(), workdir=tmp_path) as server:
        server.wait_ready(timeout_s=600)
        body = {"model": "merged", "messages": prompt, "max_tokens": 16, "temperature": 0}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].strip()
    # a 4-step adapter is close to the base model, whose answer may run past max_tokens;
    # the demo's 60-step model stops at its exported end-of-turn ("2013-05-09", "stop")
    assert choice["finish_reason"] in ("stop", "length")
