"""vLLM's --api-key behind the gateway: LORASTACK_VLLM_API_KEY goes on every request the
gateway makes to a backend (the /v1/models and /metrics scrapes, proxied chats and
streams, the passed-through routes), and a client's own Authorization header never
reaches vLLM in its place or beside it."""

from __future__ import annotations

import secrets

import httpx
from test_gateway_proxy import chat

from lorastack_testing.fake_vllm import FakeState

CLIENT_KEY = "client-key-" + secrets.token_urlsafe(16)


def _use_every_route(gw: str, headers: dict[str, str]) -> None:
    """A chat, a stream, a completion and a /tokenize through the gateway, all answered."""
    r = httpx.post(f"{gw}/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == 200, r.text
    with httpx.stream(
        "POST", f"{gw}/v1/chat/completions", json=chat(stream=True), headers=headers
    ) as s:
        assert s.status_code == 200
        assert b"[DONE]" in b"".join(s.iter_bytes())
    completion = {"model": "smollm2", "prompt": "Say hello.", "max_tokens": 4}
    r = httpx.post(f"{gw}/v1/completions", json=completion, headers=headers)
    assert r.status_code == 200, r.text
    tokenize = {"model": "smollm2", "prompt": "a b"}
    assert httpx.post(f"{gw}/tokenize", json=tokenize, headers=headers).status_code == 200


def _paths(state: FakeState) -> set[str]:
    return {path for path, _ in state.authorizations}


def test_the_gateway_sends_vllms_key_and_nobody_else_gets_in(make_gateway, fake) -> None:
    url, state = fake
    state.api_key = secrets.token_urlsafe(32)
    # the fake answers as vLLM with --api-key: 401 to whoever lacks the key
    assert httpx.post(f"{url}/v1/chat/completions", json=chat()).status_code == 401
    wrong = {"Authorization": "Bearer " + secrets.token_urlsafe(32)}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={}, headers=wrong).status_code == 401
    state.authorizations.clear()
    settings = {"vllm_api_key": state.api_key, "auth_enabled": True, "api_keys": [CLIENT_KEY]}
    with make_gateway([url], **settings) as gw:  # ready = /v1/models answered
        _use_every_route(gw, {"Authorization": f"Bearer {CLIENT_KEY}"})
    assert {"/v1/models", "/metrics", "/v1/chat/completions", "/tokenize"} <= _paths(state)
    # exactly vLLM's key on each request, the client's nowhere
    assert {auth for _, auth in state.authorizations} == {(f"Bearer {state.api_key}",)}


def test_without_a_key_nothing_is_sent(make_gateway, fake) -> None:
    url, state = fake
    assert isinstance(state, FakeState) and state.api_key is None
    with make_gateway([url]) as gw:
        _use_every_route(gw, {})
        # a client that sends a header of its own (auth is off: the gateway ignores it)
        _use_every_route(gw, {"Authorization": f"Bearer {CLIENT_KEY}"})
    assert {"/v1/models", "/metrics", "/v1/chat/completions", "/tokenize"} <= _paths(state)
    assert {auth for _, auth in state.authorizations} == {()}


def test_a_clients_key_never_reaches_vllm_when_auth_is_on(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url], auth_enabled=True, api_keys=[CLIENT_KEY]) as gw:
        _use_every_route(gw, {"Authorization": f"Bearer {CLIENT_KEY}"})
    assert len(state.calls()) == 4
    assert {auth for _, auth in state.authorizations} == {()}
