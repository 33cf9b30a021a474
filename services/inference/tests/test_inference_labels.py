"""A serve config naming `NAME@promoted` follows the label: the real supervisor app (its
routes, its loop, the label follower) over a file:// store, with the fake vLLM as the
engine (lorastack_testing.fake_engine). The served name stays `NAME-promoted`; the
version behind it (vLLM's `root`) moves when the label does, without a restart."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from inference.main import create_app
from inference.settings import InferenceSettings
from lorastack.manifest import Manifest
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store
from lorastack_testing.fake_engine import FakeEngine, publish_tiny_adapter, publish_tiny_model
from lorastack_testing.net import free_port, wait_for


def publish_adapter(
    store: ArtifactStore, tmp_path: Path, base: Manifest, seed: str, rank: int = 8
) -> Manifest:
    return publish_tiny_adapter(
        store, tmp_path / f"adapter-{seed}", base, name="demo/adapter", rank=rank
    )


@pytest.fixture
def store(tmp_path: Path) -> tuple[ArtifactStore, Manifest]:
    store = open_store(CommonSettings(home=tmp_path / "home"))
    return store, publish_tiny_model(store, tmp_path / "model")


@pytest.fixture
def serve(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path
) -> Iterator[Callable[..., TestClient]]:
    apps: list[TestClient] = []

    def start(**overrides: Any) -> TestClient:
        values: dict[str, Any] = {
            "home": tmp_path / "home", "model": "tiny", "engine": "cpu",
            "adapters": ["demo/adapter@promoted"], "port": free_port(),
            "supervisor_port": free_port(), "label_refresh_s": 0.1,
        }  # fmt: skip
        values.update(overrides)
        settings = InferenceSettings(**values)
        client = TestClient(create_app(settings, store=store[0], server_factory=FakeEngine))
        client.__enter__()
        apps.append(client)
        wait_for(lambda: client.get("/ready").status_code == 200, "ready")
        return client

    yield start
    for client in apps:
        client.__exit__(None, None, None)


def served_adapters() -> dict[str, str]:
    """What the newest engine lists in /v1/models: adapter id -> root."""
    return {m["id"]: m["root"] for m in FakeEngine.started[-1].state.models if m.get("parent")}


def test_a_moved_label_is_served_under_the_same_name_without_a_restart(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, serve: Callable[..., TestClient]
) -> None:
    st, base = store
    v1 = publish_adapter(st, tmp_path, base, "one")
    v2 = publish_adapter(st, tmp_path, base, "two")
    st.move_label("promoted", v1)
    client = serve()
    engine = FakeEngine.started[-1]
    root = served_adapters()["demo/adapter-promoted"]
    assert root.endswith(f"labels/demo/adapter-promoted/v1-{v1.digest[7:19]}")
    assert Path(root).resolve() == st.fetch(v1).resolve()  # the verified folder
    status = client.get("/status").json()
    assert status["adapters"][0]["follows"] == "demo/adapter@promoted"
    assert status["adapters"][0]["ref"] == "demo/adapter:1"

    st.move_label("promoted", v2)
    wait_for(
        lambda: client.get("/status").json()["adapters"][0]["ref"] == "demo/adapter:2", "moved"
    )
    assert FakeEngine.started[-1] is engine  # no restart
    assert served_adapters() == {
        "demo/adapter-promoted": str(tmp_path / "home/serve/labels/demo/adapter-promoted")
        + f"/v2-{v2.digest[7:19]}"
    }
    loads = engine.state.calls("/v1/load_lora_adapter")
    assert loads[-1]["load_inplace"] is True and loads[-1]["lora_name"] == "demo/adapter-promoted"
    assert client.get("/status").json()["labels"]["switches"] == 1
    metrics = client.get("/metrics").text
    assert "lorastack_inference_label_switches_total 1.0" in metrics
    assert "lorastack_inference_label_errors 0.0" in metrics


def test_a_label_moved_to_an_unservable_adapter_keeps_the_served_one(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, serve: Callable[..., TestClient]
) -> None:
    st, base = store
    v1 = publish_adapter(st, tmp_path, base, "one")
    big = publish_adapter(st, tmp_path, base, "big", rank=64)
    st.move_label("promoted", v1)
    client = serve(label_refresh_s=0)  # on request only
    st.move_label("promoted", big)
    r = client.post("/admin/labels/refresh")
    assert r.status_code == 200 and r.json()["switched"] == []
    assert "rank 64, above max_lora_rank 16" in r.json()["errors"]["demo/adapter@promoted"]
    assert client.get("/status").json()["adapters"][0]["ref"] == "demo/adapter:1"
    assert f"v1-{v1.digest[7:19]}" in served_adapters()["demo/adapter-promoted"]
    v3 = publish_adapter(st, tmp_path, base, "three")
    st.move_label("promoted", v3)
    r = client.post("/admin/labels/refresh")
    assert r.json()["switched"] == [
        {"served_name": "demo/adapter-promoted", "from": "demo/adapter:1", "to": "demo/adapter:3"}
    ]
    assert r.json()["errors"] == {}


def test_a_labelled_ref_loads_at_runtime_and_a_restart_keeps_the_version(
    store: tuple[ArtifactStore, Manifest], tmp_path: Path, serve: Callable[..., TestClient]
) -> None:
    st, base = store
    v1 = publish_adapter(st, tmp_path, base, "one")
    v2 = publish_adapter(st, tmp_path, base, "two")
    # label_refresh_s=0: only the explicit refresh below switches (a periodic one could
    # switch first and leave it nothing to report)
    client = serve(adapters=[], enable_lora=True, restart_backoff_s=0.1, label_refresh_s=0)
    r = client.post("/admin/adapters", json={"ref": "demo/adapter@promoted"})
    assert (
        r.status_code == 404
        and "lorastack promote demo/adapter:VERSION" in r.json()["error"]["hint"]
    )
    st.move_label("promoted", v1)
    r = client.post("/admin/adapters", json={"ref": "demo/adapter@promoted"})
    assert r.status_code == 201 and r.json()["served_name"] == "demo/adapter-promoted"
    st.move_label("promoted", v2)
    assert client.post("/admin/labels/refresh").json()["switched"][0]["to"] == "demo/adapter:2"
    first = FakeEngine.started[-1]
    first.kill()  # vLLM dies: the next start serves the label's version, not the config's
    wait_for(
        lambda: FakeEngine.started[-1] is not first and client.get("/ready").status_code == 200,
        "restarted",
    )
    assert f"v2-{v2.digest[7:19]}" in served_adapters()["demo/adapter-promoted"]
