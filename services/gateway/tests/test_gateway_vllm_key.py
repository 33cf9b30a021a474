"""vLLM's --api-key behind the gateway: LORASTACK_VLLM_API_KEY goes on every request the
gateway makes to a backend (the /v1/models scrape, proxied chats and streams), and a
client's own Authorization header never reaches vLLM in its place."""

from __future__ import annotations

import secrets

import httpx
from test_gateway_proxy import chat

from lorastack_testing.fake_vllm import FakeState


def test_the_gateway_sends_vllms_key_and_nobody_else_gets_in(make_gateway, fake) -> None:
    url, state = fake
    state.api_key = secrets.token_urlsafe(32)
    # the fake answers as vLLM with --api-key: 401 to whoever lacks the key
    assert httpx.post(f"{url}/v1/chat/completions", json=chat()).status_code == 401
    wrong = {"Authorization": "Bearer " + secrets.token_urlsafe(32)}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={}, headers=wrong).status_code == 401
    with make_gateway([url], vllm_api_key=state.api_key) as gw:  # ready = /v1/models answered
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=chat(stream=True)) as s:
            assert s.status_code == 200
            assert b"[DONE]" in b"".join(s.iter_bytes())


def test_without_a_key_nothing_is_sent(make_gateway, fake) -> None:
    url, state = fake
    assert isinstance(state, FakeState) and state.api_key is None
    with make_gateway([url]) as gw:
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat()).status_code == 200
