"""Promotion end to end, on fakes only at the boundaries: `lorastack eval` (against the
fake OpenAI server) publishes evidence, `lorastack promote` refuses an uncertain verdict
and accepts an improvement, and a supervisor serving `demo/adapter@promoted` (the fake
vLLM as its engine) switches the version behind `demo/adapter-promoted` without a
restart, which the gateway's `/v1/models` shows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from evaluation import EvalConfig, run_eval
from gateway.main import create_app as create_gateway
from gateway.settings import GatewaySettings
from inference.main import create_app as create_supervisor
from inference.settings import InferenceSettings
from lorastack.cli import main as cli_main
from lorastack.manifest import Manifest
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store
from lorastack_testing.fake_engine import FakeEngine, publish_tiny_adapter, publish_tiny_model
from lorastack_testing.fake_state import write_upper_case_task
from lorastack_testing.fake_vllm import FakeServer
from lorastack_testing.net import free_port, serve_in_thread, wait_for

LEARNT: set[str] = set()  # adapter versions whose answers are right (upper case)


def _answer(model: str, prompt: str) -> str:
    return prompt.upper() if model in LEARNT else prompt


@pytest.fixture
def openai_fake() -> Iterator[FakeServer]:
    with FakeServer(models=[{"id": "base"}, {"id": "v1"}, {"id": "v2"}], answer=_answer) as f:
        yield f


def evaluate(fake: FakeServer, store: ArtifactStore, tmp_path: Path, adapter: Manifest) -> None:
    test = write_upper_case_task(tmp_path / f"test-{adapter.version}.jsonl", 10)
    cfg = EvalConfig(
        base_url=fake.base_url, test=str(test), base_model="base",
        lora_model=f"v{adapter.version}", adapter=adapter.ref, scorers=["exact"],
        max_tokens=8, resamples=200,
    )  # fmt: skip
    run_eval(cfg, out_dir=tmp_path / f"eval-{adapter.version}", store=store, publish_as="demo/eval")


def test_promoted_adapter_reaches_the_gateways_models_without_a_restart(
    home: Path, tmp_path: Path, openai_fake: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(CommonSettings(home=home))
    base = publish_tiny_model(store, tmp_path / "model")
    v1 = publish_tiny_adapter(store, tmp_path / "a1", base, name="demo/adapter")
    v2 = publish_tiny_adapter(store, tmp_path / "a2", base, name="demo/adapter")
    LEARNT.clear()
    LEARNT.add("v1")
    evaluate(openai_fake, store, tmp_path, v1)
    assert cli_main(["promote", "demo/adapter:1"]) == 0

    settings = InferenceSettings(
        home=home, model="tiny", engine="cpu", adapters=["demo/adapter@promoted"],
        port=free_port(), supervisor_port=free_port(), label_refresh_s=0.1,
    )  # fmt: skip
    supervisor = TestClient(create_supervisor(settings, store=store, server_factory=FakeEngine))
    with supervisor:
        wait_for(lambda: supervisor.get("/ready").status_code == 200, "ready")
        engine = FakeEngine.started[-1]
        admin = "promotion-test-admin-" + "0123456789abcdef" * 2  # /ready's details
        gw_settings = GatewaySettings(
            home=home, backends=[engine.base_url], scrape_interval_s=0.1, admin_key=admin
        )
        with serve_in_thread(create_gateway(gw_settings), free_port()) as gateway:

            def root() -> str | None:
                models = httpx.get(f"{gateway}/v1/models", timeout=5).json()["data"]
                return {m["id"]: m["root"] for m in models}.get("demo/adapter-promoted")

            wait_for(lambda: root() is not None, "listed by the gateway")
            # the gateway's refresh waits for its first tokenizer loads (importing
            # transformers: seconds, cold); "tiny" has none, which it notes and goes on
            wait_for(
                lambda: (
                    not httpx.get(
                        f"{gateway}/ready", headers={"Authorization": f"Bearer {admin}"}
                    ).json()["loading_tokenizers"]
                ),
                "done loading tokenizers",
                timeout_s=120,
            )
            assert str(root()).endswith(f"/v1-{v1.digest[7:19]}")

            evaluate(openai_fake, store, tmp_path, v2)  # v2 learnt nothing: uncertain
            capsys.readouterr()
            assert cli_main(["promote", "demo/adapter:2"]) == 3
            assert "'uncertain' on the primary metric 'exact'" in capsys.readouterr().err

            LEARNT.add("v2")  # trained further (same bytes here), evaluated again
            evaluate(openai_fake, store, tmp_path, v2)
            assert cli_main(["promote", "demo/adapter:2"]) == 0
            wait_for(lambda: str(root()).endswith(f"/v2-{v2.digest[7:19]}"), "switched")
            assert FakeEngine.started[-1] is engine  # the same vLLM: no restart
            status = supervisor.get("/status").json()
            assert status["restarts"] == 0
            assert status["adapters"][0]["ref"] == "demo/adapter:2"
