"""Request ids end to end: accepted or made, sent to the backend (the fake vLLM records
the headers it received), returned on every response, in error bodies, stream error
events and the gateway's log lines."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from test_gateway_proxy import CHAT, chat, sse_events, wait_for

from gateway.request_id import MAX_LEN, request_id

KEY = "sk-request-id-" + "0123456789abcdef" * 2  # API keys: at least 32 characters


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        ("req-42", True),
        ("a" * MAX_LEN, True),
        ("trace id with spaces/and:punctuation", True),
        ("a" * (MAX_LEN + 1), False),  # too long
        ("bad\r\nInjected: 1", False),  # CR/LF would split the backend's request head
        ("tab\there", False),
        ("caf\u00e9", False),  # not ASCII
        ("", False),
        (None, False),
    ],
)
def test_request_id_keeps_valid_values_and_replaces_the_rest(value, kept) -> None:
    rid = request_id(value)
    if kept:
        assert rid == value
    else:
        assert rid != value and len(rid) == 32 and int(rid, 16) >= 0


def test_client_id_reaches_the_backend_and_comes_back(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url]) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
        assert state.received_headers[-1]["x-request-id"] == "abc-1"
        # absent: one is made, and the backend sees the same one the client gets
        r = httpx.post(f"{gw}/v1/completions", json={"model": "smollm2", "prompt": "hi"})
        made = r.headers["x-request-id"]
        assert r.status_code == 200 and len(made) == 32
        assert state.received_headers[-1]["x-request-id"] == made
        # an invalid one is replaced, never forwarded
        r = httpx.post(
            f"{gw}/v1/completions",
            json={"model": "smollm2", "prompt": "hi"},
            headers={"X-Request-Id": "x" * 500},
        )
        assert r.headers["x-request-id"] != "x" * 500
        assert state.received_headers[-1]["x-request-id"] == r.headers["x-request-id"]
        # streams carry it from the first byte
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json=chat(stream=True),
            headers={"X-Request-Id": "s-1"},
        ) as r:
            assert r.headers["x-request-id"] == "s-1"
            assert sse_events(r.read().decode())[-1] == "[DONE]"
        assert state.received_headers[-1]["x-request-id"] == "s-1"


def test_errors_carry_the_id_in_header_body_and_log(make_gateway, fake, caplog) -> None:
    url, state = fake
    caplog.set_level(logging.INFO, logger="gateway")
    with make_gateway([url], auth_enabled=True, api_keys=[KEY]) as gw:
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(
            f"{gw}/v1/chat/completions",
            json=chat(model="nope"),
            headers={**auth, "X-Request-Id": "e-404"},
        )
        assert r.status_code == 404 and r.headers["x-request-id"] == "e-404"
        assert r.json()["error"]["request_id"] == "e-404"
        assert any("e-404" in rec.getMessage() for rec in caplog.records)
        r = httpx.post(f"{gw}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "e-401"})
        assert r.status_code == 401 and r.json()["error"]["request_id"] == "e-401"
        # the FastAPI routes too: an error, a 404 route, a 405 on a proxied path, /health
        r = httpx.get(f"{gw}/v1/models", headers={"X-Request-Id": "m-401"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "m-401"
        assert r.json()["error"]["request_id"] == "m-401"
        r = httpx.get(f"{gw}/nowhere", headers={"X-Request-Id": "n-404"})
        assert r.status_code == 404 and r.json()["error"]["request_id"] == "n-404"
        r = httpx.get(f"{gw}/v1/chat/completions", headers={"X-Request-Id": "g-405"})
        assert r.status_code == 405 and r.json()["error"]["request_id"] == "g-405"
        assert r.headers.get_list("x-request-id") == ["g-405"]
        assert len(httpx.get(f"{gw}/health").headers["x-request-id"]) == 32
        # the backend's own error (passed through) gains the id
        state.fail_status, state.fail_count = 400, 1
        r = httpx.post(
            f"{gw}/v1/chat/completions", json=CHAT, headers={**auth, "X-Request-Id": "u-400"}
        )
        assert r.status_code == 400 and r.json()["error"]["request_id"] == "u-400"
        assert r.json()["error"]["message"] == "fake failure 400"


def test_a_stream_cut_off_names_the_id_in_its_error_event(make_gateway, fake, caplog) -> None:
    url, state = fake
    state.die_after_tokens = 2
    with make_gateway([url]) as gw:
        with httpx.stream(
            "POST",
            f"{gw}/v1/chat/completions",
            json=chat(stream=True),
            headers={"X-Request-Id": "cut-1"},
        ) as r:
            events = sse_events(r.read().decode())
        assert "[DONE]" not in events and events[-1]["error"]["request_id"] == "cut-1"
        # logged as the stream ends, which may be just after the client read the end
        wait_for(lambda: any("cut-1" in rec.getMessage() for rec in caplog.records))


def test_openai_client_sees_the_request_id(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Request-Id": "sdk-1"},
        )
        assert raw.headers["x-request-id"] == "sdk-1" and raw.parse().choices
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
        assert e.value.request_id and len(e.value.request_id) == 32


def test_header_fields_read_as_starlette_reads_them() -> None:
    """The proxy's one-dict view of the header list: the first of a repeated field, as
    `request.headers.get` gives it, None for an absent one, latin-1 values."""
    from starlette.datastructures import Headers

    from gateway.request_body import HeaderFields

    raw = [
        (b"x-request-id", b"first"),
        (b"authorization", b"Bearer k"),
        (b"x-request-id", b"second"),
        (b"x-session-id", "caf\u00e9".encode("latin-1")),
    ]
    fields, starlette = HeaderFields(raw), Headers(raw=raw)
    for name in ("x-request-id", "authorization", "x-session-id", "x-lorastack-clamp"):
        assert fields.get(name.encode()) == starlette.get(name)
    assert fields.get(b"x-request-id") == "first" and fields.get(b"x-session-id") == "caf\u00e9"
