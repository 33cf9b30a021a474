"""A LoRA request goes only to a replica whose /v1/models lists the adapter (vLLM lists what
it has loaded), whatever the other scores say; when the adapter moves, the routes follow
within a scrape. Two fake vLLM replicas on loopback, a real gateway in front."""

from __future__ import annotations

import time

import httpx
from test_gateway_proxy import chat

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
        time.sleep(0.5)  # > scrape interval (0.1 s)
        n2 = len(s2.calls())
        assert _backends(gw, "sql-lora") == {url1}
        assert len(s2.calls()) == n2

        s1.models.remove(SQL)  # loaded nowhere: a clear 404/503, never a blind forward
        time.sleep(0.5)
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="sql-lora"), timeout=30)
        assert r.status_code in (404, 503) and r.json()["error"]["message"]
        assert len(s2.calls()) == n2
