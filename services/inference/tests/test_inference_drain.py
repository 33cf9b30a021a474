"""Shutdown drains: at SIGTERM (the app's lifespan ending) the supervisor stops being ready,
waits for vLLM's open requests to end, then stops vLLM, so a replica leaving a scale-down
cuts no stream; past `drain_timeout_s` it stops anyway. vLLM is the fake (FakeEngine), its
streams held open until the test releases them."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from inference.main import create_app
from inference.settings import InferenceSettings
from inference.supervisor import Supervisor
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_testing.fake_engine import FakeEngine, publish_tiny_model
from lorastack_testing.net import free_port, wait_for


def settings(tmp_path: Path, **values: object) -> InferenceSettings:
    home = tmp_path / "home"
    publish_tiny_model(open_store(CommonSettings(home=home)), tmp_path / "model")
    return InferenceSettings(
        home=home, model="tiny", engine="cpu", port=free_port(), supervisor_port=free_port(),
        workdir=tmp_path / "serve", **values,
    )  # fmt: skip


class HeldStream(threading.Thread):
    """A streamed completion on vLLM's port, held after its first token by the fake."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__()
        self.engine = engine
        self.text = ""

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}
        r = httpx.post(f"{self.engine.base_url}/v1/completions", json=body, timeout=30)
        self.text = r.text


def test_shutdown_waits_for_open_requests_then_stops_vllm(tmp_path: Path) -> None:
    client = TestClient(
        create_app(settings(tmp_path, drain_timeout_s=60), server_factory=FakeEngine)
    )
    client.__enter__()
    supervisor: Supervisor = client.app.state.supervisor  # type: ignore[attr-defined]
    try:
        wait_for(lambda: client.get("/ready").status_code == 200, "ready", 30)
        engine = FakeEngine.started[-1]
        engine.state.hold = threading.Event()
        stream = HeldStream(engine)
        stream.start()
        wait_for(lambda: engine.state.generating == 1, "the stream open")
        stopping = threading.Thread(target=client.__exit__, args=(None, None, None))
        stopping.start()  # SIGTERM
        wait_for(lambda: supervisor.state == "draining", "draining")
        assert not supervisor.ready and engine.running  # not ready, still serving the stream
    finally:
        if engine.state.hold is not None:
            engine.state.hold.set()
    stopping.join(timeout=30)
    stream.join(timeout=30)
    assert stream.text.endswith("data: [DONE]\n\n"), stream.text[-200:]
    assert engine.state.completed == 1 and not engine.running
    assert supervisor.state == "stopped"


def test_drain_gives_up_after_its_timeout(tmp_path: Path) -> None:
    with TestClient(
        create_app(settings(tmp_path, drain_timeout_s=0), server_factory=FakeEngine)
    ) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, "ready", 30)
        supervisor: Supervisor = client.app.state.supervisor  # type: ignore[attr-defined]
        engine = FakeEngine.started[-1]
        engine.state.hold = threading.Event()
        stream = HeldStream(engine)
        stream.start()
        try:
            wait_for(lambda: engine.state.generating == 1, "the stream open")
            assert supervisor.drain(timeout_s=0.1, poll_s=0.01) is False
            assert client.get("/ready").json() == {"ready": False, "state": "draining"}
        finally:
            engine.state.hold.set()
        stream.join(timeout=30)
        assert supervisor.drain(timeout_s=5, poll_s=0.01) is True  # nothing open now
