"""Hostile input, generated: thousands of request bodies and headers (hypothesis) against
`lorastack gateway` run as its own process (uvloop + httptools, as deployed) in front of
the fake upstream. Every answer is below 500 and every 4xx is in the OpenAI error shape;
afterwards the gateway still answers a plain request and its memory has not grown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorastack_testing.net import free_port

EXAMPLES = 1500  # per property below; CI time ~1 min for all of them on 2 cores
ROUTES = ["/v1/chat/completions", "/v1/completions"]

# --- strategies ---------------------------------------------------------------------

# text as attackers write it: any code point, lone surrogates included
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), texts)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, json_values)}),
    st.dictionaries(texts, json_values, max_size=3),
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": roles, "content": st.one_of(texts, st.lists(parts, max_size=3), json_values)},
            optional={"name": json_values, "tool_calls": json_values},
        ),
        json_values,
    ),
    max_size=4,
)
field_values = {
    "model": st.one_of(st.just("smollm2"), texts, json_values),
    "messages": st.one_of(messages, json_values),
    "prompt": st.one_of(
        texts, st.lists(texts, max_size=3), st.lists(numbers, max_size=5), json_values
    ),
    "max_tokens": st.one_of(numbers, json_values),
    "max_completion_tokens": st.one_of(numbers, json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}), json_values),
    "n": st.one_of(numbers, json_values),
    "temperature": numbers,
    "add_generation_prompt": json_values,
    "continue_final_message": json_values,
    "chat_template_kwargs": st.one_of(st.dictionaries(texts, json_values, max_size=3), json_values),
    "tools": json_values,
}
bodies = st.fixed_dictionaries(
    {}, optional={k: v for k, v in field_values.items()}
) | st.dictionaries(texts, json_values, max_size=4)


@st.composite
def encoded(draw: st.DrawFn, value: Any) -> bytes:
    """JSON text of `value` as a client might send it: escaped ASCII, or raw UTF-8 where
    a lone surrogate becomes bytes that are not UTF-8; sometimes cut short or nested deep."""
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    raw = text.encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as is"] * 6 + ["cut", "deep", "garbage"]))
    if how == "cut":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "deep":
        depth = draw(st.sampled_from([63, 65, 200, 5000, 100_000]))
        raw = b'{"model": "smollm2", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    elif how == "garbage":
        raw = draw(st.binary(max_size=64))
    return raw


content_types = st.sampled_from(
    [
        None,
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/vnd.api+json",
        "",
        ";;;",
    ]
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(
    str.strip  # what a client library lets through: no whitespace at the ends
)


# --- the gateway process ---------------------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def gateway_process(
    fake: tuple[str, Any], embedded_model: Path, tmp_path: Path
) -> Iterator[tuple[str, int]]:
    url, _ = fake
    port = free_port()
    env = {
        **os.environ,
        "LORASTACK_HOME": str(tmp_path / "home"),
        "LORASTACK_BACKENDS": url,
        "LORASTACK_TOKENIZERS": json.dumps({"smollm2": str(embedded_model)}),
        "LORASTACK_PORT": str(port),
        "LORASTACK_MAX_BODY_BYTES": str(256 * 1024),
        "LORASTACK_SCRAPE_INTERVAL_S": "0.2",
    }
    log = (tmp_path / "gateway.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastack.cli", "gateway"], env=env, stdout=log, stderr=log
    )
    gw = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            try:
                if httpx.get(f"{gw}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway never became ready"
            time.sleep(0.1)
        yield gw, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _check(r: httpx.Response, sent: str) -> None:
    assert r.status_code < 500, f"{r.status_code} for {sent}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err, dict), r.text
        assert isinstance(err["message"], str) and len(err["message"]) > 10, r.text
        assert {"type", "param", "code"} <= set(err), r.text


def test_generated_hostile_requests_never_get_a_5xx(gateway_process: tuple[str, int]) -> None:
    gw, pid = gateway_process
    sent = {"n": 0, "4xx": 0}
    hypothesis_settings = settings(
        max_examples=EXAMPLES,
        derandomize=True,  # the same requests on every CI run
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    with httpx.Client(base_url=gw, timeout=30) as client:

        def send(method: str, path: str, raw: bytes, headers: dict[str, str]) -> None:
            r = client.request(method, path, content=raw, headers=headers)
            sent["n"] += 1
            sent["4xx"] += 400 <= r.status_code < 500
            _check(r, f"{method} {path} {headers} {raw[:300]!r}")

        @hypothesis_settings
        @given(
            path=st.sampled_from(ROUTES),
            raw=bodies.flatmap(encoded),
            ctype=content_types,
            clamp=st.one_of(st.none(), header_values),
        )
        def bodies_on_proxied_routes(
            path: str, raw: bytes, ctype: str | None, clamp: str | None
        ) -> None:
            headers = {"content-type": ctype} if ctype is not None else {}
            if clamp is not None:
                headers["x-lorastack-clamp"] = clamp
            send("POST", path, raw, headers)

        @hypothesis_settings
        @given(
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
            path=st.sampled_from([*ROUTES, "/v1/models", "/health", "/ready", "/metrics", "/x"])
            | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(
                lambda p: "/" + p.lstrip("/")
            ),
            raw=st.binary(max_size=64),
            auth=st.one_of(st.none(), header_values),
        )
        def other_methods_and_routes(method: str, path: str, raw: bytes, auth: str | None) -> None:
            headers = {"authorization": auth} if auth is not None else {}
            send(method, path, raw, headers)

        warm = client.post("/v1/chat/completions", json={"model": "smollm2", "messages": []})
        _check(warm, "warm-up")
        bodies_on_proxied_routes()
        rss_before = _rss_kib(pid)  # after the first thousands: caches and arenas are warm
        n_before = sent["n"]
        other_methods_and_routes()
        bodies_on_proxied_routes()  # the same requests again: nothing may pile up
        rss_after = _rss_kib(pid)

        ok = client.post(
            "/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    print(
        f"fuzz: {sent['n']} requests, {sent['4xx']} answered 4xx; RSS {rss_before} -> {rss_after} KiB"
    )
    assert sent["n"] >= 3 * EXAMPLES and sent["4xx"] > EXAMPLES
    # a leak of even 1 KiB per request would show as several MiB over the second half
    assert rss_after - rss_before < 8 * 1024, (n_before, rss_before, rss_after)
