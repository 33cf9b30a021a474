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
from typing import Any

import httpx
import pytest
import yaml
from dashboard_queries import missing_from, trainer_metric_names
from prometheus_client.parser import text_string_to_metric_families

from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_app.local_stack import GATEWAY_PORT, SUPERVISOR_PORT, VLLM_PORT, port_taken

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
    if taken := [p for p in (VLLM_PORT, SUPERVISOR_PORT, GATEWAY_PORT) if port_taken(p)]:
        pytest.skip(
            f"ports {taken} of 127.0.0.1 are taken (by `make demo`'s services? "
            "'.venv/bin/lorastack down' stops them): the demo here needs them"
        )
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
    from inference.engine import EngineSpec, VllmServer
    from inference.parity import check, read_reference
    from lorastack_testing.net import free_port

    home, _ = demo
    store = open_store(CommonSettings(home=home))
    merged = store.fetch(store.resolve("date-iso/merged"))
    prompt = [{"role": "user", "content": "Convert to ISO 8601: the ninth of May, 2013"}]
    with VllmServer(
        EngineSpec(model_dir=merged, served_name="merged", port=free_port(), workdir=tmp_path)
    ) as server:
        server.wait_ready(timeout_s=600)
        body = {"model": "merged", "messages": prompt, "max_tokens": 16, "temperature": 0}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        # the merged model carries the adapter's reference: served, it answers as trained
        reference = read_reference(merged)
        assert reference is not None
        verdict = check(server.base_url, "merged", reference, served_dtype="float32")
    assert verdict.ok, verdict.problems
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].strip()
    # a 4-step adapter is close to the base model, whose answer may run past max_tokens;
    # the demo's 60-step model stops at its exported end-of-turn ("2013-05-09", "stop")
    assert choice["finish_reason"] in ("stop", "length")


# ---- parity: what vLLM serves is what was trained (lorastack.parity) ---------------------


def _adapter_reference(home: Path) -> tuple[Path, Any]:
    from inference.parity import read_reference

    store = open_store(CommonSettings(home=home))
    folder = store.fetch(store.resolve("date-iso/adapter"))
    reference = read_reference(folder)
    assert reference is not None, "the trainer published the adapter without its reference"
    return folder, reference


@pytest.mark.slow
def test_the_served_adapter_is_checked_against_its_training(demo: tuple[Path, str]) -> None:
    home, log = demo
    _, reference = _adapter_reference(home)
    assert (reference.recorded_by, reference.dtype, reference.device) == (
        "trainer",
        "float32",
        "cpu",
    )
    status = httpx.get(f"http://127.0.0.1:{SUPERVISOR_PORT}/status", timeout=30).json()
    assert status["dtype"]["served"] == "float32"
    verdict = status["parity"]["date-iso/adapter-v1"]
    assert verdict["ok"] is True, verdict
    assert verdict["greedy_identical"] == verdict["probes"] == len(reference.probes)
    assert "parity date-iso/adapter-v1: pass" in log  # the demo says it
    metrics = httpx.get(f"http://127.0.0.1:{SUPERVISOR_PORT}/metrics", timeout=30).text
    assert 'lorastack_inference_parity_ok{model="date-iso/adapter-v1"} 1.0' in metrics


@pytest.mark.slow
def test_the_demo_serves_its_adapter_only_after_the_verdict(demo: tuple[Path, str]) -> None:
    """vLLM starts on the base beside the training (the demo's serve.yaml lists no adapter);
    the trained adapter is loaded at runtime, judged under a private name first, and only
    then served under its own (the supervisor's log, in order)."""
    home, log = demo
    serve_yaml = yaml.safe_load((home / "demo" / "serve.yaml").read_text())
    assert "adapters" not in serve_yaml and serve_yaml["enable_lora"] is True
    assert log.index("== train") < log.index("== serve the adapter") < log.index("== chat")
    supervisor_log = (home / "logs" / "inference.log").read_text()
    verdict = supervisor_log.index("parity date-iso/adapter-v1: pass")
    loaded = supervisor_log.index("loaded adapter date-iso/adapter:1 as date-iso/adapter-v1")
    assert verdict < loaded


def _replay(reference: Any, model: str, **kw: Any) -> Any:
    from inference.parity import check

    return check(f"http://127.0.0.1:{VLLM_PORT}", model, reference, served_dtype="float32", **kw)


@pytest.mark.slow
def test_a_model_trained_with_another_chat_template_is_named(demo: tuple[Path, str]) -> None:
    """The reference as another template renders the prompts (a line before every
    conversation), replayed through the live vLLM, which renders them with its own."""
    from transformers import AutoTokenizer

    home, _ = demo
    folder, reference = _adapter_reference(home)
    tok = AutoTokenizer.from_pretrained(folder)
    other = "{{ 'Answer briefly.\\n' }}" + tok.chat_template
    for probe in reference.probes:
        text = tok.apply_chat_template(
            probe.messages, chat_template=other, add_generation_prompt=True, tokenize=False
        )
        probe.prompt_text, probe.prompt_ids = text, tok(text, add_special_tokens=False).input_ids
    verdict = _replay(reference, "date-iso/adapter-v1")
    assert not verdict.ok and "chat template" in verdict.problems[0], verdict.problems


@pytest.mark.slow
def test_a_model_trained_with_another_tokenizer_is_named(demo: tuple[Path, str]) -> None:
    """The same prompt text cut into other tokens, as another tokenizer would."""
    from transformers import AutoTokenizer

    home, _ = demo
    folder, reference = _adapter_reference(home)
    tok = AutoTokenizer.from_pretrained(folder)
    for probe in reference.probes:
        cut = len(probe.prompt_text) - 20  # inside the user's words
        head, rest = probe.prompt_text[:cut], probe.prompt_text[cut:]
        probe.prompt_ids = [
            *tok(head, add_special_tokens=False).input_ids,
            *tok(rest, add_special_tokens=False).input_ids,
        ]
    verdict = _replay(reference, "date-iso/adapter-v1")
    assert not verdict.ok and "tokenizer" in verdict.problems[0], verdict.problems


@pytest.mark.slow
def test_an_adapter_served_over_another_base_is_named(demo: tuple[Path, str]) -> None:
    """The adapter's reference replayed where its weights are not (the base alone), on a
    base of another digest: both the base and the numbers are named."""
    home, _ = demo
    _, reference = _adapter_reference(home)
    verdict = _replay(reference, "smollm2", served_base_digest="sha256:" + "0" * 64)
    assert not verdict.ok
    assert "trained on base" in verdict.problems[0], verdict.problems
    assert "the weights served are not the weights trained" in verdict.problems[1]


def _publish_and_load(home: Path, folder: Path, name: str) -> tuple[Any, httpx.Response]:
    """Publish `folder` as adapter `name` of the demo adapter's base and ask the running
    supervisor to load it; the demo adapter's manifest and the answer."""
    store = open_store(CommonSettings(home=home))
    adapter = store.resolve("date-iso/adapter")
    store.publish(folder, kind="adapter", name=name, service="test", parents=adapter.parents)
    r = httpx.post(
        f"http://127.0.0.1:{SUPERVISOR_PORT}/admin/adapters", json={"ref": name}, timeout=300
    )
    return adapter, r


@pytest.mark.slow
def test_refuse_unloads_a_failing_adapter_and_warn_serves_it(
    demo: tuple[Path, str], tmp_path: Path
) -> None:
    """An adapter whose reference its served answers contradict (published as the trainer
    would, with its answers altered): the supervisor (parity: auto = refuse) refuses its
    runtime load with the reason and unloads it; `warn` reports the same verdict and serves."""
    import shutil

    from inference.parity import ParityChecks
    from lorastack.parity import REFERENCE_FILE

    home, _ = demo
    folder, reference = _adapter_reference(home)
    for probe in reference.probes:
        probe.output_logprobs = [lp - 2.0 for lp in probe.output_logprobs]
    altered = tmp_path / "altered"
    shutil.copytree(folder, altered)
    (altered / REFERENCE_FILE).write_text(reference.model_dump_json())
    adapter, r = _publish_and_load(home, altered, "altered/adapter")
    assert r.status_code >= 400 and "differs from the model that was trained" in r.text, r.text
    assert "max |Δ log-prob|" in r.text
    status = httpx.get(f"http://127.0.0.1:{SUPERVISOR_PORT}/status", timeout=30).json()
    assert "altered/adapter-v1" not in {a["served_name"] for a in status["adapters"]}
    assert status["parity"]["altered/adapter-v1"]["ok"] is False
    httpx.delete(
        f"http://127.0.0.1:{SUPERVISOR_PORT}/admin/adapters/altered/adapter-v1", timeout=60
    )
    warn = ParityChecks("warn", served_dtype="float32", api_key=None)
    checked = warn.check(  # the same weights, served
        f"http://127.0.0.1:{VLLM_PORT}",
        "date-iso/adapter-v1",
        altered,
        served_base_digest=adapter.parents[0].digest,
    )
    assert checked.serve and checked.outcome == "warned"
    assert warn.results()["date-iso/adapter-v1"].ok is False


@pytest.mark.slow
def test_the_adapter_at_half_its_scale_is_refused_and_never_listed(
    demo: tuple[Path, str], tmp_path: Path
) -> None:
    """The trained adapter with its LoRA scale halved (lora_alpha / 2), published with the
    trained reference: a near miss whose greedy answers may still agree. vLLM loads it
    under a private name; the control refuses it; no client could reach it."""
    import json
    import shutil

    from lorastack.parity import CHECK_PREFIX

    home, _ = demo
    folder, _ = _adapter_reference(home)
    half = tmp_path / "half"
    shutil.copytree(folder, half)
    cfg = json.loads((half / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] / 2
    (half / "adapter_config.json").write_text(json.dumps(cfg))
    _, r = _publish_and_load(home, half, "half/adapter")
    assert r.status_code == 409 and "differs from the model that was trained" in r.text, r.text
    models = httpx.get(f"http://127.0.0.1:{VLLM_PORT}/v1/models", timeout=30).json()["data"]
    ids = {m["id"] for m in models}
    assert "half/adapter-v1" not in ids and not any(i.startswith(CHECK_PREFIX) for i in ids)
    record = httpx.get(f"http://127.0.0.1:{SUPERVISOR_PORT}/status", timeout=30).json()
    verdict = record["parity"]["half/adapter-v1"]  # float32: at most 0.5% may be left
    assert verdict["ok"] is False and verdict["control_ratio"] > 0.005, verdict
