"""Pure request checks, token arithmetic, the error map, /metrics parsing and key buckets."""

from __future__ import annotations

import json

import pytest
from test_gateway_limits import admit

from gateway.auth import Authenticator
from gateway.errors import (
    BadRequest,
    ContextLengthExceeded,
    RateLimited,
    Unauthorized,
    UpstreamRejected,
    error_response,
    sse_error_event,
)
from gateway.limits import TokenBucket
from gateway.metrics import GatewayMetrics
from gateway.scrape import parse_metrics, parse_models
from gateway.settings import GatewaySettings
from gateway.validation import parse_chat, parse_completion, plan_tokens, requested_output

A_KEY, B_KEY = ("sk-" + c * 32 for c in "ab")  # API keys: at least 32 characters


@pytest.mark.parametrize(
    ("prompt", "requested", "clamp", "max_tokens", "clamped_from"),
    [
        (100, 50, False, 50, None),
        (100, None, False, 1948, None),  # no max_tokens: up to the end of the context
        (100, 1948, False, 1948, None),  # exactly fits
        (100, 5000, True, 1948, 5000),
        (2047, 10, True, 1, 10),
    ],
)
def test_plan_tokens(
    prompt: int, requested: int | None, clamp: bool, max_tokens: int, clamped_from: int | None
) -> None:
    plan = plan_tokens(prompt, requested, 2048, clamp=clamp, param="max_tokens")
    assert (plan.max_tokens, plan.clamped_from) == (max_tokens, clamped_from)


def test_overflow_message_gives_three_numbers_and_a_fix() -> None:
    with pytest.raises(ContextLengthExceeded) as e:
        plan_tokens(100, 1949, 2048, clamp=False, param="max_completion_tokens")
    body = e.value.body()["error"]
    assert (
        "2048" in body["message"]
        and "100 in the prompt" in body["message"]
        and "1949" in body["message"]
    )
    assert "max_completion_tokens to at most 1948" in body["message"]
    assert (body["param"], body["code"], e.value.status) == (
        "max_completion_tokens",
        "context_length_exceeded",
        400,
    )
    for clamp in (False, True):  # a prompt without room is refused even in clamp mode
        with pytest.raises(ContextLengthExceeded):
            plan_tokens(2048, None, 2048, clamp=clamp, param="max_tokens")


def test_request_parsing() -> None:
    req = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "seed": 1,
        },
        4,
    )
    assert requested_output(req) == ("max_completion_tokens", 5)
    assert req.model_extra == {"seed": 1}  # unknown fields pass through
    with pytest.raises(BadRequest, match="at most 1"):
        parse_chat({"model": "m", "messages": [{"role": "user"}] * 2}, 1)
    with pytest.raises(BadRequest, match="max_tokens"):
        parse_chat({"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}, 4)
    with pytest.raises(BadRequest, match="model"):
        parse_chat({"messages": [{"role": "user"}]}, 4)
    assert requested_output(parse_completion({"model": "m", "prompt": "p"})) == ("max_tokens", 16)


def test_error_map_and_sse_event() -> None:
    r = error_response(Unauthorized("missing API key", "send a key"))
    assert r.status_code == 401 and json.loads(r.body)["error"] == {
        "message": "missing API key send a key",
        "type": "AuthenticationError",
        "param": None,
        "code": "invalid_api_key",
    }
    r = error_response(ValueError("boom"))  # an unexpected error: 500, no internals
    assert r.status_code == 500 and "boom" not in r.body.decode()
    upstream = UpstreamRejected(
        400,
        b'{"error":{"message":"vllm says no","type":"BadRequestError","param":null,"code":400}}',
    )
    assert json.loads(error_response(upstream).body)["error"]["message"] == "vllm says no"
    event = sse_error_event(RateLimited("slow down", retry_after_s=3))
    first, rest = event.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "rate_limit_exceeded"
    assert rest == b""  # no [DONE]: the answer was cut off


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.31
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.12
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="geo"} 1.8e9
"""


def test_parse_vllm_metrics() -> None:
    m = parse_metrics(VLLM_METRICS)
    assert (m.kv_usage, m.running, m.waiting, m.preemptions) == (0.31, 3, 4, 5.0)
    assert (
        m.running_adapters == {"sql", "chat"} and m.waiting_adapters == {"geo"} and m.max_lora == 2
    )
    old = parse_metrics("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n")
    assert old.kv_usage == 0.5 and old.running == 0
    assert parse_metrics("").kv_usage is None


def test_parse_models() -> None:
    models = parse_models(
        {
            "data": [
                {"id": "base", "max_model_len": 2048, "root": "/m", "parent": None},
                {"id": "sql", "root": "/a", "parent": "base", "max_model_len": None},
            ]
        }
    )
    assert models["sql"].parent == "base" and models["sql"].max_model_len is None
    assert models["base"].max_model_len == 2048 and models["base"].parent is None


def test_keys_and_buckets(tmp_path) -> None:
    s = GatewaySettings(
        home=tmp_path,
        auth_enabled=True,
        api_keys=f"{A_KEY},team-b={B_KEY}",
        key_requests_per_min=2,
        key_tokens_per_min=100,
    )  # type: ignore[arg-type]
    now = [0.0]
    auth = Authenticator.from_settings(s, GatewayMetrics())
    auth.clock = lambda: now[0]
    kid = auth.authenticate(f"Bearer {A_KEY}")
    # named by place or alias, never by the secret or a hash of it (/metrics shows names)
    assert kid.name == "key-1" and auth.authenticate(f"Bearer {B_KEY}").name == "team-b"
    for header in (None, f"Basic {A_KEY}", "Bearer ", "Bearer c-key"):
        with pytest.raises(Unauthorized):
            auth.authenticate(header)
    admit(auth, kid, 40)
    admit(auth, kid, 40)
    with pytest.raises(RateLimited) as e:  # the third request in the same instant
        admit(auth, kid, 1)
    assert e.value.headers() == {  # one request refills in 60/2 s; both in 60 s
        "Retry-After": "30",
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "60s",
    }
    now[0] = 30.0
    admit(auth, kid, 40)  # 20 left + 50 refilled = 70 tokens
    with pytest.raises(RateLimited, match="at most 100 tokens per minute"):
        admit(auth, kid, 101)
    bucket = TokenBucket(60)
    assert bucket.wait_s(61, 0.0) == pytest.approx(1.0)


def test_settings_parse_env_style_values(tmp_path) -> None:
    s = GatewaySettings(
        home=tmp_path, backends="http://a:8000/v1, http://b:8000/", tokenizers="m=/x,n=store-ref"
    )  # type: ignore[arg-type]
    assert s.backends == ["http://a:8000", "http://b:8000"]
    assert s.tokenizers == {"m": "/x", "n": "store-ref"}
    with pytest.raises(ValueError, match="http"):
        GatewaySettings(home=tmp_path, backends=["ftp://x"])
    with pytest.raises(ValueError, match="api_keys"):
        GatewaySettings(home=tmp_path, auth_enabled=True)
