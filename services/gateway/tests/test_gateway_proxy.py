"""The gateway against the fake upstream: length checks, streaming, failures, routing,
admission control, auth and metrics, all over real HTTP on loopback."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorastack_testing.fake_state import FakeState

ADMIN_KEY = "gateway-test-admin-" + "0123456789abcdef" * 2  # >= 32 characters, no placeholder
ONE_KEY = "sk-one-" + "0123456789abcdef" * 2  # API keys: at least 32 characters too
FILE_KEY = "sk-from-file-" + "0123456789abcdef" * 2
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
METRICS_KEY = "gateway-test-metrics-" + "0123456789abcdef" * 2  # what Prometheus sends
METRICS = {"Authorization": f"Bearer {METRICS_KEY}"}  # an open gateway ignores it
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}]}


def chat(**extra: Any) -> dict[str, Any]:
    return {**CHAT, **extra}


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=METRICS).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def wait_rescraped(gw: str, *backends: tuple[str, FakeState]) -> None:
    """Until the gateway has applied a scrape of each backend that began after this call:
    what a test changed in a fake is seen, however long a loaded machine takes (a sleep
    "longer than the scrape interval" is not). The marker is the preemptions counter, which
    the gateway only mirrors; two rounds, as a scrape reads /v1/models before /metrics: the
    scrape that shows the second marker started after the one that showed the first had
    ended, so after this call."""
    for _ in range(2):
        for _url, state in backends:
            state.preemptions += 1
        for url, state in backends:
            wait_for(lambda u=url, s=state: _preemptions_seen(gw, u) == s.preemptions)


def _preemptions_seen(gw: str, url: str) -> float:
    return metric(gw, "lorastack_gateway_backend_preemptions", backend=url)


def test_overflow_is_400_and_upstream_never_called(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url]) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=2040))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        prompt = int(err["message"].split("(")[1].split(" in the prompt")[0])
        assert "2048 tokens" in err["message"] and f"at most {2048 - prompt}" in err["message"]
        # the same with max_completion_tokens, and a prompt that alone is too long
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_completion_tokens=4000))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        long = chat(messages=[{"role": "user", "content": "word " * 3000}])
        r = httpx.post(f"{gw}/v1/chat/completions", json=long)
        assert r.status_code == 400 and "leaves no room" in r.json()["error"]["message"]
        r = httpx.post(
            f"{gw}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2048}
        )
        assert r.status_code == 400
        assert state.calls() == []  # the backend saw nothing
        assert metric(gw, "lorastack_gateway_rejections_total", reason="context_length") == 4
        # a request that fits goes through, and says its prompt size
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=2048 - prompt))
        assert r.status_code == 200, r.text
        assert r.headers["x-lorastack-prompt-tokens"] == str(prompt)
        assert len(state.calls()) == 1
        # small enough for the upper bound to settle the check: forwarded at once and
        # counted while the backend works; the count is the same exact one
        for stream in (False, True):
            r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=16, stream=stream))
            assert r.status_code == 200, r.text
            assert r.headers["x-lorastack-prompt-tokens"] == str(prompt)
        assert len(state.calls()) == 3


def test_clamp_mode_by_header_and_by_setting(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url]) as gw:
        r = httpx.post(
            f"{gw}/v1/chat/completions",
            json=chat(max_tokens=5000),
            headers={"X-Lorastack-Clamp": "1"},
        )
        assert r.status_code == 200, r.text
        prompt = int(r.headers["x-lorastack-prompt-tokens"])
        assert r.headers["x-lorastack-clamped-max-tokens"] == f"5000->{2048 - prompt}"
        assert state.calls()[-1]["max_tokens"] == 2048 - prompt
    with make_gateway([url], clamp_max_tokens=True) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_completion_tokens=3000))
        assert r.status_code == 200
        assert state.calls()[-1]["max_completion_tokens"] == 2048 - prompt
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=10))
        assert "x-lorastack-clamped-max-tokens" not in r.headers  # it fits: untouched
        assert state.calls()[-1]["max_tokens"] == 10


def test_unknown_model_is_404_naming_valid_models(make_gateway, fake) -> None:
    url, state = fake
    state.models.append({"id": "sql-lora", "max_model_len": 2048, "parent": "smollm2"})
    with make_gateway([url]) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="gpt-4"))
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["code"] == "model_not_found"
        assert "gpt-4" in err["message"] and "smollm2, sql-lora" in err["message"]
        assert state.calls() == []
        models = httpx.get(f"{gw}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            ("smollm2", None),
            ("sql-lora", "smollm2"),
        ]
        # an adapter counts with its parent's tokenizer
        assert (
            httpx.post(f"{gw}/v1/chat/completions", json=chat(model="sql-lora")).status_code == 200
        )


def test_limits_on_body_and_messages(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url], max_body_bytes=2048, max_messages=3) as gw:
        r = httpx.post(
            f"{gw}/v1/chat/completions",
            json=chat(messages=[{"role": "user", "content": "x" * 5000}]),
        )
        assert r.status_code == 413
        msgs = [{"role": "user", "content": "hi"}] * 4
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(messages=msgs))
        assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"]
        r = httpx.post(f"{gw}/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{gw}/v1/chat/completions", json={"model": "smollm2", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert httpx.get(f"{gw}/v1/nothing").json()["error"]["type"] == "NotFoundError"
        assert state.calls() == []


def test_streaming_passes_chunks_and_strips_added_usage(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url]) as gw:
        # pieces arrive as the backend sends them, not at once: the first token reaches the
        # client while the backend's next one is 30 s away (arrival times 0.05 s apart
        # compared with the wall clock could bunch up on a loaded machine)
        state.pace_s = 30.0
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            pieces = r.iter_text()  # kept: a dropped iterator closes the response
            first = ""
            while "Hello" not in first:
                first += next(pieces)
            assert state.completed == 0 and state.active == 1  # mid-stream
        wait_for(lambda: state.cancelled == 1)
        state.pace_s = 0.0
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            text = "".join(r.iter_text())
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        assert (
            "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
            == "Hello, world! Bye."
        )
        assert all(e["choices"] for e in events[:-1])  # the usage event the gateway added is gone
        assert state.calls()[-1]["stream_options"] == {"include_usage": True}
        # a client that asks for usage gets it
        body = chat(stream=True, stream_options={"include_usage": True})
        events = sse_events(httpx.post(f"{gw}/v1/chat/completions", json=body).text)
        assert events[-2]["usage"]["completion_tokens"] == 6 and events[-2]["choices"] == []


def test_client_disconnect_cancels_upstream(make_gateway, fake) -> None:
    url, state = fake
    state.tokens = [f" t{i}" for i in range(200)]
    # the second token is 30 s away: only the hang-up ends the stream (at 0.05 s a token
    # it ended by itself after 10 s, which a loaded machine could outlast)
    state.pace_s = 30.0
    with make_gateway([url]) as gw:
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=chat(stream=True)) as r:
            it = r.iter_bytes()
            got = b""
            while b" t0" not in got:  # the first token reached the client
                got += next(it)
            wait_for(lambda: state.active == 1)
        wait_for(lambda: state.cancelled == 1 and state.active == 0)
        wait_for(lambda: metric(gw, "lorastack_gateway_inflight_requests") == 0)
        assert state.completed == 0


def test_disconnect_during_slow_first_byte_cancels_upstream(make_gateway, fake) -> None:
    url, state = fake
    state.first_byte_delay_s = 1.0
    state.pace_s = 0.05
    state.tokens = [f" t{i}" for i in range(100)]
    with make_gateway([url]) as gw:
        host, port = gw.removeprefix("http://").split(":")
        body = json.dumps(chat(stream=True)).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_for(lambda: len(state.calls()) == 1)
        wait_for(lambda: state.cancelled == 1)
        wait_for(lambda: metric(gw, "lorastack_gateway_inflight_requests") == 0)


def test_upstream_dying_mid_stream_gives_one_error_event(make_gateway, fake) -> None:
    url, state = fake
    state.die_after_tokens = 3
    state.pace_s = 0.01
    with make_gateway([url]) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200  # the stream had started
        events = sse_events(r.text)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "upstream_broken"
        assert events[-1] is errors[0] and "[DONE]" not in events  # cut off, not complete
        assert len(state.calls()) == 1  # never retried after the stream started
        assert metric(gw, "lorastack_gateway_upstream_errors_total", kind="broken_stream") == 1


def test_idle_gap_mid_stream_gives_one_timeout_event(make_gateway, fake) -> None:
    url, state = fake
    # the first token comes at once, the next after 30 s: only the idle timeout can end it
    # (a 0.6 s gap raced a late 0.2 s timer on a loaded machine)
    state.pace_s = 30.0
    with make_gateway([url], idle_timeout_s=0.2) as gw:
        t0 = time.monotonic()
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True), timeout=60)
        assert time.monotonic() - t0 < 30  # ended by the idle timeout, not by the backend
        events = sse_events(r.text)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "upstream_timeout"
        assert "0.2 s" in errors[0]["error"]["message"]
        assert events[-1] is errors[0] and "[DONE]" not in events
        assert events[0]["choices"]  # the first token got through
        assert metric(gw, "lorastack_gateway_upstream_errors_total", kind="timeout") == 1
        wait_for(lambda: state.cancelled == 1)  # the upstream request was closed
        wait_for(lambda: metric(gw, "lorastack_gateway_inflight_requests") == 0)


def test_slow_first_byte_is_504_and_steady_stream_is_not_cut(make_gateway, fake) -> None:
    url, state = fake
    # the head comes after 30 s: only the first-byte limit can answer first (0.6 s raced a
    # late 0.2 s timer); then gaps 60x under the idle limit, in a stream longer than it
    # (0.1 s gaps under 0.3 s let a stalled thread cut the stream)
    state.first_byte_delay_s = 30.0
    with make_gateway([url], first_byte_timeout_s=0.2, idle_timeout_s=3.0) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True), timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        state.first_byte_delay_s = 0.0
        state.tokens = [f" t{i}" for i in range(80)]
        state.pace_s = 0.05  # every gap under the idle limit: a 4 s stream goes through
        body = chat(stream=True, max_tokens=80)
        r = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=60)
        assert sse_events(r.text)[-1] == "[DONE]" and "error" not in r.text
        assert r.text.count(" t79") == 1  # the whole answer


def test_proxied_routes_answer_405_to_other_methods(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url]) as gw:
        r = httpx.get(f"{gw}/v1/chat/completions")
        assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"]
        assert httpx.get(f"{gw}/nowhere").status_code == 404


def test_retries_before_first_byte_only_on_503_and_prefers_other_backend(
    make_gateway, fake, second_fake
) -> None:
    url1, s1 = fake
    url2, s2 = second_fake
    s1.kv_usage, s2.kv_usage = 0.1, 0.5  # the first is preferred
    s1.fail_status, s1.fail_count = 503, 100
    with make_gateway([url1, url2]) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat())
        assert r.status_code == 200 and r.headers["x-lorastack-backend"] == url2
        assert len(s1.calls()) == 1 and len(s2.calls()) == 1
        # a 500 is not retried: the backend's own error comes back
        s1.fail_status, s1.fail_count = 500, 1
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat())
        assert r.status_code == 500 and "fake failure 500" in r.json()["error"]["message"]
        assert len(s2.calls()) == 1
        assert metric(gw, "lorastack_gateway_retries_total") == 1


def test_all_attempts_fail_gives_503(make_gateway, fake) -> None:
    url, state = fake
    state.fail_status, state.fail_count = 503, 100
    with make_gateway([url], retry_attempts=3) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 503 and "after 3 attempts" in r.json()["error"]["message"]
        assert len(state.calls()) == 3


def test_routing_prefers_lower_kv_usage_and_loaded_adapter(make_gateway, fake, second_fake) -> None:
    url1, s1 = fake
    url2, s2 = second_fake
    for s in (s1, s2):
        s.models.append({"id": "sql-lora", "max_model_len": 2048, "parent": "smollm2"})
    s1.kv_usage, s2.kv_usage = 0.8, 0.2
    with make_gateway([url1, url2]) as gw:
        backends = {
            httpx.post(f"{gw}/v1/chat/completions", json=chat()).headers["x-lorastack-backend"]
            for _ in range(5)
        }
        assert backends == {url2}
        s1.running_adapters = ["sql-lora"]  # loaded on the fuller backend only
        wait_rescraped(gw, fake, second_fake)
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(model="sql-lora"))
        assert r.headers["x-lorastack-backend"] == url1


def test_saturation_gives_429_with_retry_after(make_gateway, fake) -> None:
    url, state = fake
    state.kv_usage, state.waiting = 0.99, 20
    with make_gateway(
        [url], admit_max_kv_usage=0.9, admit_max_waiting=4, scrape_interval_s=2.0
    ) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat())
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "overloaded"
        assert state.calls() == []
        assert metric(gw, "lorastack_gateway_rejections_total", reason="overloaded") == 1


def test_upstream_error_series_start_at_zero_for_each_backend(make_gateway, fake) -> None:
    """So the dashboard's errors panel shows 0, not "No data", while nothing failed."""
    url, _ = fake

    def zero_kinds(gw: str) -> set[str]:
        families = text_string_to_metric_families(httpx.get(f"{gw}/metrics").text)
        return {
            s.labels["kind"]
            for fam in families
            for s in fam.samples
            if s.name == "lorastack_gateway_upstream_errors_total"
            and s.labels.get("backend") == url
            and s.value == 0
        }

    with make_gateway([url]) as gw:
        wait_for(lambda: zero_kinds(gw) == {"connect", "status_5xx", "timeout", "broken_stream"})


def test_old_kv_metric_name_is_read(make_gateway, fake) -> None:
    url, state = fake
    state.old_kv_name, state.kv_usage = True, 0.42
    with make_gateway([url]) as gw:
        wait_for(
            lambda: metric(gw, "lorastack_gateway_backend_kv_cache_usage", backend=url) == 0.42
        )


def test_auth_and_rate_limits(make_gateway, fake, tmp_path) -> None:
    url, state = fake
    keys = tmp_path / "keys"
    keys.write_text(f"# team a\n{FILE_KEY}\n")
    with make_gateway(
        [url],
        auth_enabled=True,
        api_keys=[ONE_KEY],
        api_keys_file=keys,
        key_requests_per_min=3,
        metrics_key=METRICS_KEY,
    ) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat())
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = httpx.post(
            f"{gw}/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer nope"}
        )
        assert r.status_code == 401 and "nope" not in r.text
        assert httpx.get(f"{gw}/v1/models").status_code == 401
        ok = {"Authorization": f"Bearer {ONE_KEY}"}
        assert [
            httpx.post(f"{gw}/v1/chat/completions", json=chat(), headers=ok).status_code
            for _ in range(4)
        ] == [200, 200, 200, 429]
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(), headers=ok)
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 20
        other = {"Authorization": f"Bearer {FILE_KEY}"}  # its own bucket
        assert (
            httpx.post(f"{gw}/v1/chat/completions", json=chat(), headers=other).status_code == 200
        )
        assert len(state.calls()) == 4
        assert metric(gw, "lorastack_gateway_rejections_total", reason="unauthorized") == 3
        assert metric(gw, "lorastack_gateway_rejections_total", reason="rate_limited") == 2
    with make_gateway([url], auth_enabled=True, api_keys=[ONE_KEY], key_tokens_per_min=300) as gw:
        h = {"Authorization": f"Bearer {ONE_KEY}"}
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=400), headers=h)
        assert (
            r.status_code == 429 and "at most 300 tokens per minute" in r.json()["error"]["message"]
        )
        prompt = int(
            httpx.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=200), headers=h).headers[
                "x-lorastack-prompt-tokens"
            ]
        )
        # prompt + 200 reserved, prompt + 6 used, the rest refunded: 250 more fit
        assert (
            httpx.post(
                f"{gw}/v1/chat/completions", json=chat(max_tokens=250 - prompt), headers=h
            ).status_code
            == 200
        )


def test_metric_values_after_known_sequence(make_gateway, fake) -> None:
    url, state = fake
    state.pace_s = 0.02
    state.kv_usage, state.running, state.waiting, state.preemptions = 0.25, 3, 1, 7
    with make_gateway([url]) as gw:
        for _ in range(3):
            assert (
                httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True)).status_code == 200
            )
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat()).status_code == 200
        assert (
            httpx.post(
                f"{gw}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 4}
            ).status_code
            == 200
        )
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat(model="nope")).status_code == 404
        m = lambda name, **kw: metric(gw, name, **kw)  # noqa: E731
        assert (
            m("lorastack_gateway_request_duration_seconds_count", route="chat", status="200") == 4
        )
        assert m("lorastack_gateway_request_duration_seconds_count", route="completion") == 1
        assert m("lorastack_gateway_time_to_first_token_seconds_count") == 3
        assert m("lorastack_gateway_time_per_output_token_seconds_count") == 3
        tpot_mean = m("lorastack_gateway_time_per_output_token_seconds_sum") / 3
        assert 0.015 < tpot_mean < 0.1  # tokens were paced 20 ms apart
        assert m("lorastack_gateway_output_tokens_sum") == 6 * 4 + 4
        assert m("lorastack_gateway_rejections_total", reason="unknown_model") == 1
        assert m("lorastack_gateway_inflight_requests") == 0
        assert m("lorastack_gateway_backend_kv_cache_usage", backend=url) == 0.25
        assert m("lorastack_gateway_backend_requests_running", backend=url) == 3
        assert m("lorastack_gateway_backend_requests_waiting", backend=url) == 1
        assert m("lorastack_gateway_backend_preemptions", backend=url) == 7
        assert m("lorastack_gateway_backend_up", backend=url) == 1
        help_line = next(
            line
            for line in httpx.get(f"{gw}/metrics").text.splitlines()
            if "HELP lorastack_gateway_time_per_output_token" in line
        )
        assert "(end-to-end - TTFT) / (output tokens - 1)" in help_line


def test_backend_down_then_up(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url, "http://127.0.0.1:9"], admin_key=ADMIN_KEY) as gw:
        ready = httpx.get(f"{gw}/ready", headers=ADMIN).json()
        assert (
            ready["backends"][url] == "up"
            and "ConnectError" in ready["backends"]["http://127.0.0.1:9"]
        )
        assert httpx.post(f"{gw}/v1/chat/completions", json=chat()).status_code == 200


def test_usage_is_asked_of_the_backend_whatever_the_body_says(make_gateway, fake) -> None:
    """The gateway adds `stream_options.include_usage` by splicing the client's bytes when
    the body has no `stream_options`, else by writing the body again: either way the
    backend gets one `stream_options` with usage on, and the client no usage event."""
    url, state = fake
    bodies = [
        b'  \n{"model":"smollm2","stream":true,"messages":[{"role":"user","content":"Hi {x}"}]}',
        json.dumps(chat(stream=True, stream_options=None)).encode(),
        json.dumps(chat(stream=True, stream_options={"continuous_usage_stats": False})).encode(),
    ]
    with make_gateway([url]) as gw:
        for i, body in enumerate(bodies):
            r = httpx.post(
                f"{gw}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 200, r.text
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])
            sent = state.calls()[-1]
            assert sent["stream_options"]["include_usage"] is True
            assert sent["messages"] == json.loads(body)["messages"]
            if i == 2:
                assert sent["stream_options"]["continuous_usage_stats"] is False
