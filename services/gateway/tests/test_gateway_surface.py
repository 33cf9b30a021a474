"""The rest of the OpenAI surface through the gateway, against the fake vLLM:
`GET /v1/models/{id}` (the official client's `models.retrieve`), and vLLM's `/tokenize`
and `/detokenize` passed through with the chat routes' auth and model check."""

from __future__ import annotations

import httpx
import openai
import pytest


def test_models_retrieve_with_the_openai_client(make_gateway, fake) -> None:
    url, state = fake
    state.models.append({"id": "org/adapter-1", "parent": "smollm2", "root": "/a"})
    with make_gateway([url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        m = client.models.retrieve("smollm2")
        assert m.id == "smollm2" and m.object == "model"
        assert m.model_extra and m.model_extra["max_model_len"] == 2048
        adapter = client.models.retrieve("org/adapter-1")  # an id with a slash
        assert adapter.model_extra and adapter.model_extra["parent"] == "smollm2"
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("nope")
        body = e.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found"
        assert "smollm2" in body["message"] and body["param"] == "model"


def test_models_retrieve_needs_a_key_when_auth_is_on(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url], auth_enabled=True, api_keys=["sk-1"]) as gw:
        assert httpx.get(f"{gw}/v1/models/smollm2").status_code == 401
        ok = httpx.get(f"{gw}/v1/models/smollm2", headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200 and ok.json()["id"] == "smollm2"


def test_tokenize_and_detokenize_pass_through(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url], auth_enabled=True, api_keys=["sk-1"]) as gw:
        auth = {"Authorization": "Bearer sk-1", "X-Request-Id": "tok-1"}
        r = httpx.post(
            f"{gw}/tokenize", json={"model": "smollm2", "prompt": "a bb ccc"}, headers=auth
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [1, 2, 3] and r.json()["count"] == 3
        assert r.headers["x-request-id"] == "tok-1"
        assert state.calls("/tokenize")[-1] == {"model": "smollm2", "prompt": "a bb ccc"}
        assert state.received_headers[-1]["x-request-id"] == "tok-1"
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "x yy"}]}
        assert httpx.post(f"{gw}/tokenize", json=chat, headers=auth).json()["count"] == 2
        r = httpx.post(
            f"{gw}/detokenize", json={"model": "smollm2", "tokens": [1, 2]}, headers=auth
        )
        assert r.status_code == 200 and r.json()["prompt"] == "w ww"
        # the chat routes' checks: key, model, body
        sent = len(state.received)
        r = httpx.post(f"{gw}/tokenize", json={"model": "smollm2", "prompt": "a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{gw}/tokenize", json={"model": "nope", "prompt": "a"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(f"{gw}/tokenize", json={"prompt": "a"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = httpx.post(f"{gw}/tokenize", content=b"[1,", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["request_id"] == "tok-1"
        assert len(state.received) == sent  # none of them reached the backend
