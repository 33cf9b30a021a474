"""A LoRA request goes only to a replica whose /v1/models lists the adapter (vLLM lists what
it has loaded), whatever the other scores say; when the adapter moves, the routes follow
within a scrape; a declared adapter that no replica lists yet is a 503 with Retry-After.
Two fake vLLM replicas on loopback, a real gateway in front."""

from __future__ import annotations

import httpx
from test_gateway_proxy import chat, wait_rescraped

from lorastack.settings import CommonSettings
from lorastack.store import declared, open_store
from lorastack.store.declared import DeclaredAdapter

SQL = {"id": "sql-lora", "max_model_len": 2048, "parent": "smollm2"}


def _backends(gw: str, model: str, n: int = 6) -> set[str]:
    out = set()
    for _ in range(n):
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model=model), timeout=30)
        assert r.status_code == 200, r.text
        out.add(r.headers["x-lorastack-backend"])
    return out


def test_lora_requests_reach_only_replicas_with_the_adapter_loaded(
    make_gateway, fake, second_fake
) -> None:
    (url1, s1), (url2, s2) = fake, second_fake
    s1.kv_usage, s2.kv_usage = 0.0, 0.9  # every score but placement prefers replica 1
    s2.models.append(SQL)
    with make_gateway([url1, url2]) as gw:
        assert _backends(gw, "sql-lora") == {url2}
        assert s1.calls() == []
        assert _backends(gw, "smollm2") == {url1}  # the base is on both: scores decide

        s1.models.append(SQL)  # loaded on replica 1, then unloaded from replica 2
        s2.models.remove(SQL)
        wait_rescraped(gw, fake, second_fake)
        n2 = len(s2.calls())
        assert _backends(gw, "sql-lora") == {url1}
        assert len(s2.calls()) == n2

        s1.models.remove(SQL)  # loaded nowhere: a clear 404/503, never a blind forward
        wait_rescraped(gw, fake, second_fake)
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="sql-lora"), timeout=30)
        assert r.status_code in (404, 503) and r.json()["error"]["message"]
        assert len(s2.calls()) == n2


def test_a_declared_adapter_no_replica_lists_yet_is_503_with_retry_after(
    make_gateway, fake, second_fake, tmp_path
) -> None:
    """The replicas load what their deployment declares on their own; until one lists the
    adapter, the gateway says so (503 adapter_loading, Retry-After), never forwards blind."""
    (url1, s1), (url2, s2) = fake, second_fake
    store = open_store(CommonSettings(home=tmp_path / "home"))
    declared.declare(
        store.backend, "smollm2", DeclaredAdapter(ref="sql/lora:1", served_name="sql-lora")
    )
    with make_gateway([url1, url2], declared_refresh_s=0.1) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="sql-lora"), timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "adapter_loading"
        assert "declared for deployment smollm2" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert s1.calls() == [] and s2.calls() == []
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="no-such"), timeout=30)
        assert r.status_code == 404  # neither listed nor declared

        s2.models.append(SQL)  # replica 2 has loaded it
        wait_rescraped(gw, fake, second_fake)
        assert _backends(gw, "sql-lora") == {url2}
        assert s1.calls() == []
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'lorastack_gateway_rejections_total{reason="adapter_loading"} 1.0' in metrics


def test_an_unreadable_declaration_never_fails_a_request(make_gateway, fake, tmp_path) -> None:
    url1, _ = fake
    store = open_store(CommonSettings(home=tmp_path / "home"))
    store.backend.put_record(declared.declaration_key("smollm2", 1), b"{not json")
    with make_gateway([url1], declared_refresh_s=0.1) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="sql-lora"), timeout=30)
        assert r.status_code == 404, r.text  # the store's error is logged, not answered
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat(), timeout=30).status_code == 200
