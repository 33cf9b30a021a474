"""What the fake vLLM is and does, as plain data: `FakeState` (answers, timing, queueing,
failures, the `/metrics` values, and the records of what it received), and the answer
it plans for one request (`plan_answer`: the pieces, the finish reason, the prompt
tokens). The ASGI app that serves them is lorastack_testing.fake_vllm; answer functions
and the upper-case test task that the evaluation tests score live here beside them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AnswerFn = Callable[[str, str], str]  # (model, prompt text) -> answer text
# (model, prompt token ids) -> the next token's most likely ids and their log-probs
ScoreFn = Callable[[str, list[int]], dict[int, float]]


def echo_answer(model: str, prompt: str) -> str:
    """An `AnswerFn` that answers with the prompt itself."""
    return prompt


def write_upper_case_task(path: Path, n: int) -> Path:
    """A test split of `n` chats 'wordI' -> 'WORDI': a model whose `answer` upper-cases the
    prompt scores 1 on it, one that echoes it (`echo_answer`) scores 0."""
    from lorastack.chat_data import Conversation, write_jsonl

    convs = [
        Conversation.model_validate(
            {"messages": [{"role": "user", "content": f"word{i}"},
                          {"role": "assistant", "content": f"WORD{i}"}]}
        )
        for i in range(n)
    ]  # fmt: skip
    write_jsonl(path, convs)
    return path


@dataclass
class FakeState:
    """What the fake vLLM serves and how (models, tokens, pace, failures, /metrics values),
    and what it received."""

    models: list[dict[str, Any]] = field(
        default_factory=lambda: [{"id": "smollm2", "max_model_len": 2048}]
    )
    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!", " Bye", "."])
    answer: AnswerFn | None = None  # set: its words are the tokens (instead of `tokens`)
    ttft_s: float = 0.0  # seconds from a running slot to the first content chunk
    pace_s: float = 0.0  # seconds between content chunks
    first_byte_delay_s: float = 0.0  # seconds before the response starts
    max_running: int = 0  # requests generating at once; 0 = no limit
    fail_status: int | None = None  # answer this status (before any byte) ...
    fail_count: int = 0  # ... to this many requests, then serve normally
    fail_every: int = 0  # answer every Nth completion request with HTTP 500 (0: never)
    die_after_tokens: int | None = None  # kill the connection after this many tokens
    hold: threading.Event | None = None  # set: streams wait for it after their first token
    prompt_tokens: int | None = 10  # what usage reports; None: the prompt's words
    send_usage: bool = True  # honour stream_options.include_usage
    embeds: bool = False  # serve /v1/embeddings (an embedding model)
    api_key: str | None = None  # vLLM's --api-key: /v1/* answers 401 without Bearer KEY
    # set: /v1/completions of token ids with `logprobs` decode greedily by this scorer and
    # answer with vLLM's logprobs shape (tokens as "token_id:N"), as the parity replay asks
    scorer: ScoreFn | None = None
    # /metrics values (added to what the fake itself is doing)
    kv_usage: float = 0.0  # 0..1
    kv_per_request: float = 0.0  # when > 0: KV usage = this x requests generating
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    max_lora: int = 1
    old_kv_name: bool = False  # emit vllm:gpu_cache_usage_perc instead (older vLLM)
    # set: /metrics has vllm:cache_config_info (num_gpu_blocks x block_size tokens of KV),
    # and a request that finds too few free blocks for its prompt + answer counts a
    # preemption, as vLLM would preempt a running one to make room
    num_gpu_blocks: int | None = None
    block_size: int = 16  # tokens per KV block
    metrics_down: bool = False  # /metrics answers 500
    # records
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    received_headers: list[dict[str, str]] = field(default_factory=list)  # one per `received`
    # (path, every Authorization header it carried: () for none) of every request, the
    # scrapes' GETs and the requests refused for the key included
    authorizations: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    cancelled: int = 0  # requests (streamed or not) whose client went away before the end
    completed: int = 0
    active: int = 0  # streams being served now
    generating: int = 0  # requests holding a running slot now
    queued: int = 0  # requests waiting for one
    waited: int = 0  # requests that found every running slot taken (and queued)
    kv_blocks_used: int = 0  # blocks held by requests generating now (with num_gpu_blocks)

    def calls(self, path: str = "") -> list[dict[str, Any]]:
        """The bodies of the requests received on paths ending in `path`."""
        return [body for p, body in self.received if p.endswith(path)]


def message_text(content: Any) -> str:
    """A message's text: a string, or OpenAI content parts [{"type": "text", "text": ...}]."""
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def plan_answer(s: FakeState, body: dict[str, Any], chat: bool) -> tuple[list[str], str, int]:
    """(the streamed pieces, finish_reason, prompt tokens) for one request body."""
    if chat:
        users = [
            message_text(m.get("content"))
            for m in body.get("messages", [])
            if m.get("role") == "user"
        ]
        prompt = users[-1] if users else ""
    else:
        prompt = str(body.get("prompt", ""))
    if s.answer is None:
        source = list(s.tokens)
    else:
        words = s.answer(str(body.get("model", "")), prompt).split()
        source = [w if i == 0 else " " + w for i, w in enumerate(words)]
    wanted = body.get("max_completion_tokens") if chat else None  # a chat-only field
    limit = wanted or body.get("max_tokens") or len(source)
    if body.get("ignore_eos"):  # exactly max_tokens tokens
        pieces = list(itertools.islice(itertools.cycle(source or ["x"]), limit))
        finish = "length"
    else:
        pieces = source[:limit]
        finish = "length" if limit < len(source) else "stop"
    prompt_tokens = len(prompt.split()) if s.prompt_tokens is None else s.prompt_tokens
    return pieces, finish, prompt_tokens


def score_completion(s: FakeState, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /v1/completions answer for token-id prompts with `logprobs`: greedy decoding
    by `s.scorer`, each step's top `logprobs` tokens, a choice per prompt."""
    assert s.scorer is not None
    prompts = (
        body["prompt"]
        if body["prompt"] and isinstance(body["prompt"][0], list)
        else [body["prompt"]]
    )
    choices = []
    for index, prompt in enumerate(prompts):
        seq, tops = list(prompt), []
        for _ in range(int(body.get("max_tokens") or 16)):
            top = s.scorer(body["model"], seq)
            best = sorted(top.items(), key=lambda kv: -kv[1])[: int(body["logprobs"])]
            seq.append(best[0][0])
            tops.append({f"token_id:{t}": lp for t, lp in best})
        ids = seq[len(prompt) :]
        choices.append({
            "index": index, "text": "", "finish_reason": "length",
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops},
        })  # fmt: skip
    return {"object": "text_completion", "model": body["model"], "choices": choices}
