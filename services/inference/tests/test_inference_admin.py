"""/admin/* changes what every client is served, so it needs the admin key; without a key
set, only a supervisor bound to loopback answers it. vLLM never starts (no lifespan): the
key check comes before anything touches the engine or the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from inference.main import create_app, prepare
from inference.settings import InferenceSettings
from lorastack.errors import ConfigError
from lorastack.store import open_store

KEY = "inference-admin-test-" + "0123456789abcdef" * 2  # the admin key needs 32 characters


def _client(home: Path, embedded_model: Path, **settings: str) -> TestClient:
    cfg = InferenceSettings(home=home, model="smollm2-135m-instruct", engine="cpu", **settings)
    store = open_store(cfg)
    store.publish(embedded_model, kind="base-model", name="smollm2-135m-instruct", service="test")
    return TestClient(create_app(cfg, plan=prepare(cfg, store), store=store))


@pytest.fixture(scope="module")
def keyed(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    home = tmp_path_factory.mktemp("admin-home")
    return _client(home, embedded_model, admin_key=KEY, supervisor_host="0.0.0.0")


@pytest.mark.parametrize("header", [None, "Bearer wrong", KEY, f"Basic {KEY}", "Bearer "])
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
    r = keyed.delete("/admin/adapters/chat/adapter-v1", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "no adapter" in r.json()["error"]["message"]


def test_admin_is_off_on_a_public_bind_without_a_key(embedded_model: Path, tmp_path: Path) -> None:
    client = _client(tmp_path, embedded_model, supervisor_host="0.0.0.0")
    r = client.delete("/admin/adapters/chat/adapter-v1")
    assert r.status_code == 403 and "LORASTACK_ADMIN_KEY" in r.json()["error"]["hint"]
    assert client.get("/status").status_code == 200  # the rest of the supervisor answers


@pytest.mark.parametrize(
    ("key", "why"),
    [("", "empty"), ("   ", "empty"), ("REPLACE_ME", "placeholder"), ("changeme", "placeholder"),
     ("s3cret", "fewer than 32")],
)  # fmt: skip
def test_an_empty_placeholder_or_short_admin_key_is_refused_at_start(key: str, why: str) -> None:
    """An empty key opened /admin to anyone sending `Bearer ` (compare_digest of b"" and b"");
    an example file's placeholder or a short key is one an attacker can guess."""
    with pytest.raises((ConfigError, ValueError), match=why):
        InferenceSettings(model="smollm2-135m-instruct", engine="cpu", admin_key=key)
