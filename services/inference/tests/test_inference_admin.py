"""/admin/* changes what every client is served, so it needs the admin key; without a key
set, only a supervisor bound to loopback answers it. vLLM never starts (no lifespan): the
key check comes before anything touches the engine or the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from inference.main import create_app, prepare
from inference.settings import InferenceSettings
from lorastack.store import open_store


def _client(home: Path, embedded_model: Path, **settings: str) -> TestClient:
    cfg = InferenceSettings(home=home, model="smollm2-135m-instruct", engine="cpu", **settings)
    store = open_store(cfg)
    store.publish(embedded_model, kind="base-model", name="smollm2-135m-instruct", service="test")
    return TestClient(create_app(cfg, plan=prepare(cfg, store), store=store))


@pytest.fixture(scope="module")
def keyed(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    home = tmp_path_factory.mktemp("admin-home")
    return _client(home, embedded_model, admin_key="s3cret", supervisor_host="0.0.0.0")


@pytest.mark.parametrize("header", [None, "Bearer wrong", "s3cret", "Basic s3cret"])
def test_admin_without_the_key_is_401_and_loads_nothing(
    keyed: TestClient, header: str | None
) -> None:
    headers = {} if header is None else {"authorization": header}
    for r in (
        keyed.post("/admin/adapters", json={"ref": "chat/adapter"}, headers=headers),
        keyed.delete("/admin/adapters/chat/adapter-v1", headers=headers),
    ):
        assert r.status_code == 401, r.text
        assert r.json()["error"]["hint"] == "send Authorization: Bearer KEY"
    assert keyed.get("/status").json()["adapters"] == []


def test_admin_with_the_key_reaches_the_supervisor(keyed: TestClient) -> None:
    r = keyed.delete("/admin/adapters/chat/adapter-v1", headers={"authorization": "Bearer s3cret"})
    assert r.status_code == 404 and "no adapter" in r.json()["error"]["message"]


def test_admin_is_off_on_a_public_bind_without_a_key(embedded_model: Path, tmp_path: Path) -> None:
    client = _client(tmp_path, embedded_model, supervisor_host="0.0.0.0")
    r = client.delete("/admin/adapters/chat/adapter-v1")
    assert r.status_code == 403 and "LORASTACK_ADMIN_KEY" in r.json()["error"]["hint"]
    assert client.get("/status").status_code == 200  # the rest of the supervisor answers
