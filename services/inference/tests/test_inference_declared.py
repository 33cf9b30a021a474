"""Declared adapters: replicas of one deployment over one file:// store, each the real
supervisor app (its routes, its loop, the reconciler) with the fake vLLM as its engine
(lorastack_testing.fake_engine). What one replica declares, the others serve; a replica
killed with SIGKILL (a process of its own) comes back serving it; an entry a replica cannot
serve is reported, never fatal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.testclient import TestClient

from inference.main import create_app
from inference.settings import InferenceSettings
from lorastack.manifest import Manifest
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, declared, open_store
from lorastack.store.declared import DeclaredAdapter
from lorastack_testing.fake_engine import FakeEngine, publish_tiny_adapter, publish_tiny_model
from lorastack_testing.net import free_port, wait_for

FAKE_SERVE = Path(__file__).parent / "fake_serve.py"


@pytest.fixture
def store(tmp_path: Path) -> tuple[ArtifactStore, Manifest]:
    store = open_store(CommonSettings(home=tmp_path / "home"))
    return store, publish_tiny_model(store, tmp_path / "model")


def replica_settings(tmp_path: Path, name: str) -> dict[str, Any]:
    return {
        "home": str(tmp_path / "home"), "model": "tiny", "engine": "cpu", "enable_lora": True,
        "port": free_port(), "supervisor_port": free_port(), "adapter_sync_s": 0.1,
        "label_refresh_s": 0, "workdir": str(tmp_path / name),
    }  # fmt: skip


@pytest.fixture
def replica(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> Iterator[Callable[..., TestClient]]:
    apps: list[TestClient] = []

    def start(name: str, **overrides: Any) -> TestClient:
        values = replica_settings(tmp_path, name) | overrides
        app = create_app(InferenceSettings(**values), store=store[0], server_factory=FakeEngine)
        client = TestClient(app)
        client.__enter__()
        apps.append(client)
        wait_for(lambda: client.get("/ready").status_code == 200, f"{name} ready")
        return client

    yield start
    for client in apps:
        client.__exit__(None, None, None)


def listed(client: TestClient) -> set[str]:
    """The adapters the replica's (fake) vLLM lists in /v1/models now."""
    engine = client.app.state.supervisor.server  # type: ignore[attr-defined]
    return {m["id"] for m in engine.state.models if m.get("parent")}


def adapter(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, name: str, **kw: Any
) -> Manifest:
    st, base = store
    return publish_tiny_adapter(st, tmp_path / name.replace("/", "-"), base, name=name, **kw)


def test_what_one_replica_declares_the_other_serves(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, replica: Callable[..., TestClient]
) -> None:
    a, b = replica("a"), replica("b")
    adapter(store, tmp_path, "chat/adapter")
    r = a.post("/admin/adapters", json={"ref": "chat/adapter"})  # the latest: pinned to :1
    assert r.status_code == 201, r.text
    assert r.json()["served_name"] == "chat/adapter-v1"
    assert r.json()["declared"] == {"deployment": "tiny", "seq": 1}
    assert "chat/adapter-v1" in listed(a)
    # the reconciling pass is over when its record says so: vLLM lists the adapter a moment
    # before the pass counts it (it failed here once, under two busy loops, on the count)
    wait_for(lambda: b.get("/status").json()["declared"]["loads"] == 1, "B loads what A declared")
    assert "chat/adapter-v1" in listed(b)
    status = b.get("/status").json()
    assert status["declared"]["adapters"][0]["ref"] == "chat/adapter:1"
    assert [x["source"] for x in status["adapters"]] == ["declared"]
    assert status["declared"]["loads"] == 1 and status["declared"]["errors"] == {}
    metrics = b.get("/metrics").text
    assert "lorastack_inference_declared_adapters 1.0" in metrics
    assert 'lorastack_inference_declared_changes_total{change="load"} 1.0' in metrics

    again = b.post("/admin/adapters", json={"ref": "chat/adapter:1"})
    assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]
    r = b.delete("/admin/adapters/chat/adapter-v1")
    assert r.status_code == 200 and r.json()["declared"]["seq"] == 2
    assert r.json()["unloaded"]["served_name"] == "chat/adapter-v1"
    wait_for(lambda: a.get("/status").json()["declared"]["unloads"] == 1, "A unloads it")
    assert "chat/adapter-v1" not in listed(a)
    assert a.delete("/admin/adapters/chat/adapter-v1").status_code == 404


def test_an_entry_a_replica_cannot_serve_is_reported_and_the_rest_served(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, replica: Callable[..., TestClient]
) -> None:
    st = store[0]
    adapter(store, tmp_path, "chat/adapter")
    adapter(store, tmp_path, "chat/big", rank=64)
    for ref, served in (
        ("chat/big:1", "chat/big-v1"), ("chat/gone:1", "chat/gone-v1"),
        ("chat/adapter:1", "chat/adapter-v1"),
    ):  # fmt: skip
        declared.declare(st.backend, "tiny", DeclaredAdapter(ref=ref, served_name=served))
    a = replica("a")
    wait_for(lambda: "chat/adapter-v1" in listed(a), "the servable entry loaded")
    wait_for(lambda: len(a.get("/status").json()["declared"]["errors"]) == 2, "errors shown")
    errors = a.get("/status").json()["declared"]["errors"]
    assert "rank 64, above max_lora_rank 16" in errors["chat/big:1"]
    assert "DELETE /admin/adapters/chat/big-v1" in errors["chat/big:1"]
    assert "chat/gone:1" in errors["chat/gone:1"] and "store ls chat/gone" in errors["chat/gone:1"]
    assert a.get("/ready").status_code == 200
    assert "lorastack_inference_declared_errors 2.0" in a.get("/metrics").text

    r = a.delete("/admin/adapters/chat/big-v1")  # declared, never loaded here
    assert r.status_code == 200 and r.json()["unloaded"] is None
    assert set(a.post("/admin/adapters/refresh").json()["errors"]) == {"chat/gone:1"}

    r = a.post("/admin/adapters", json={"ref": "chat/big:1"})  # refused before declaring
    assert r.status_code == 409 and "max_lora_rank" in r.json()["error"]["message"]
    assert "chat/big-v1" not in declared.current(st.backend, "tiny").served_names()


def _start(config: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, str(FAKE_SERVE), str(config)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def test_a_killed_replica_comes_back_serving_the_declared_adapter(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, replica: Callable[..., TestClient]
) -> None:
    adapter(store, tmp_path, "chat/adapter")
    values = replica_settings(tmp_path, "proc")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(values))
    sup, vllm = (
        f"http://127.0.0.1:{values['supervisor_port']}",
        f"http://127.0.0.1:{values['port']}",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTACK_")}
    log = tmp_path / "serve.log"

    def ready() -> bool:
        try:
            return httpx.get(sup + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def served() -> set[str]:
        models = httpx.get(vllm + "/v1/models", timeout=2).json()["data"]
        return {m["id"] for m in models if m.get("parent")}

    proc = _start(config, log, env)
    try:
        wait_for(ready, "the replica process ready", 60)
        b = replica("b")
        r = httpx.post(sup + "/admin/adapters", json={"ref": "chat/adapter:1"}, timeout=30)
        assert r.status_code == 201, r.text
        wait_for(lambda: "chat/adapter-v1" in listed(b), "B serves it")

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        with pytest.raises(httpx.HTTPError):
            served()
        proc = _start(config, log, env)
        wait_for(ready, "the killed replica ready again", 60)
        wait_for(
            lambda: httpx.get(sup + "/status", timeout=5).json()["declared"]["loads"] == 1,
            "it loads the declared adapter again",
        )
        assert "chat/adapter-v1" in served()
        status = httpx.get(sup + "/status", timeout=5).json()
        assert [x["served_name"] for x in status["adapters"]] == ["chat/adapter-v1"]
        assert status["declared"]["loads"] == 1 and status["declared"]["errors"] == {}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_a_damaged_declaration_keeps_what_is_served_and_says_so(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, replica: Callable[..., TestClient]
) -> None:
    st = store[0]
    adapter(store, tmp_path, "chat/adapter")
    a = replica("a")
    assert a.post("/admin/adapters", json={"ref": "chat/adapter:1"}).status_code == 201
    st.backend.put_record(declared.declaration_key("tiny", 2), b"{not json")
    errors = a.post("/admin/adapters/refresh").json()
    assert "00000002.json" in errors["skipped"] and "remove that record" in errors["skipped"]
    assert "store" in a.get("/status").json()["declared"]["errors"]
    assert a.get("/ready").status_code == 200 and "chat/adapter-v1" in listed(a)
