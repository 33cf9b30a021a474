"""The proxied routes' boundary, side by side with the FastAPI routes.

`GatewayApp` serves /v1/chat/completions, /v1/completions and /v1/responses before FastAPI (its
middleware stack and router cost time on every streamed chunk), so whatever FastAPI would
give a route, the proxy must give itself: these tests hold the two kinds of route to the
same auth, the same error shape for a wrong method or path, body size limits, and the
same metrics; and they fail when middleware is added, which the proxied routes would
silently skip.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from test_gateway_proxy import CHAT, METRICS_KEY, metric

from gateway.main import PROXIED, create_app
from gateway.settings import GatewaySettings

KEY = "sk-boundary-" + "0123456789abcdef" * 2  # API keys: at least 32 characters

COMPLETION = {"model": "smollm2", "prompt": "Say hello.", "max_tokens": 4}
# every route a client calls with a key: (method, path, JSON body)
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 4}),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/responses", {"model": "smollm2", "input": "Say hello.", "max_output_tokens": 4}),
]
PROXIED_ROUTES = sum(p in PROXIED for _, p, _ in ROUTES)
UNAUTHORIZED = ("lorastack_gateway_rejections_total", {"reason": "unauthorized"})


def test_no_middleware_the_proxied_routes_would_skip(tmp_path: Path) -> None:
    app = create_app(GatewaySettings(home=tmp_path / "home"))
    assert app.user_middleware == [], (
        "middleware does not run for the proxied routes (GatewayApp.__call__ serves them "
        "before FastAPI): do the work in the proxy, or route the proxied paths through it"
    )
    assert {p for _, p, _ in ROUTES if p in PROXIED} == set(PROXIED)


def test_auth_is_the_same_on_every_route(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url], auth_enabled=True, api_keys=[KEY], metrics_key=METRICS_KEY) as gw:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path, body in ROUTES:
                r = httpx.request(method, gw + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["type"] == "AuthenticationError" and err["message"], (path, err)
        assert metric(gw, UNAUTHORIZED[0], **UNAUTHORIZED[1]) == 3 * len(ROUTES)
        assert state.calls() == []  # no backend saw an unauthenticated request
        for method, path, body in ROUTES:
            r = httpx.request(
                method, gw + path, json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
            assert r.status_code == 200, (path, r.text)
        assert len(state.calls()) == PROXIED_ROUTES
        assert metric(gw, UNAUTHORIZED[0], **UNAUTHORIZED[1]) == 3 * len(ROUTES)


def test_a_wrong_method_or_path_gets_the_same_error_shape(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url]) as gw:
        answers = {
            "proxied, wrong method": httpx.get(f"{gw}/v1/chat/completions"),
            "FastAPI, wrong method": httpx.post(f"{gw}/v1/models", json={}),
            "no such route": httpx.post(f"{gw}/v1/nope", json={}),
        }
        shapes = {name: sorted(r.json()["error"]) for name, r in answers.items()}
        assert len(set(map(tuple, shapes.values()))) == 1, shapes
        assert answers["proxied, wrong method"].status_code == 405
        assert answers["FastAPI, wrong method"].status_code == 405
        assert answers["no such route"].status_code == 404


def test_body_limits_and_metrics_on_the_proxied_routes(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url], max_body_bytes=2048) as gw:
        big = "x" * 4096
        for path, body in ((p, b) for _, p, b in ROUTES if p in PROXIED):
            assert body is not None
            padded = {**body, "user": big}
            r = httpx.post(gw + path, json=padded)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["message"]
            # the same body sent in chunks, with no content-length to refuse it early
            chunks = iter([httpx.Request("POST", "/", json=padded).content])
            r = httpx.post(gw + path, content=chunks, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
        assert state.calls() == []
        assert metric(gw, "lorastack_gateway_rejections_total") == 2 * PROXIED_ROUTES
        before = metric(gw, "lorastack_gateway_request_duration_seconds_count")
        for _, path, body in ROUTES[1:]:
            assert httpx.post(gw + path, json=body).status_code == 200
        after = metric(gw, "lorastack_gateway_request_duration_seconds_count")
        assert after - before == PROXIED_ROUTES
        assert metric(gw, "lorastack_gateway_inflight_requests") == 0


def test_a_json_body_declared_as_a_form_gets_415_naming_the_header(make_gateway, fake) -> None:
    """`curl -d` without `-H` declares its body `application/x-www-form-urlencoded`: valid
    JSON under that type is refused, as vLLM and OpenAI's API refuse it, with the header to
    send; the same bytes with no content type at all are read as JSON."""
    url, state = fake
    posts = [(path, json.dumps(body).encode()) for _, path, body in ROUTES if body is not None]
    posts.append(("/tokenize", json.dumps({"model": "smollm2", "prompt": "a b"}).encode()))
    with make_gateway([url]) as gw:
        for path, raw in posts:
            form = {"content-type": "application/x-www-form-urlencoded"}
            r = httpx.post(gw + path, content=raw, headers=form)
            assert r.status_code == 415, (path, r.text)
            message = r.json()["error"]["message"]
            assert "'Content-Type: application/json'" in message and "curl -d" in message, message
        assert state.calls() == []
        for path, raw in posts:
            r = httpx.post(gw + path, content=raw)
            assert "content-type" not in r.request.headers
            assert r.status_code == 200, (path, r.text)
        assert len(state.calls()) == len(posts)


def test_forwarded_headers_reach_the_fastapi_routes_from_trusted_hosts(tmp_path: Path) -> None:
    """`lorastack gateway` runs uvicorn without its X-Forwarded-* middleware; the app puts
    it in front of the FastAPI routes, with uvicorn's default trusted hosts: a redirect's
    scheme follows X-Forwarded-Proto from a trusted proxy and only from one."""
    app = create_app(GatewaySettings(home=tmp_path, backends=["http://127.0.0.1:9"]))

    async def redirect_from(client: tuple[str, int]) -> str:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            r = await c.get("/health/", headers={"x-forwarded-proto": "https"})
            assert r.status_code == 307 and r.headers["x-request-id"]
            return r.headers["location"]

    assert asyncio.run(redirect_from(("127.0.0.1", 5000))) == "https://gw/health"
    assert asyncio.run(redirect_from(("10.0.0.9", 5000))) == "http://gw/health"
