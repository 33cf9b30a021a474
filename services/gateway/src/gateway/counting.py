"""How many tokens a request's prompts take, before it is forwarded, and what is left to
count while the backend works.

Counting is on the critical path of every request (0.15-0.3 ms of the gateway's added
latency, bench/gateway/history.md). When an upper bound on the prompt's tokens
(`CountingTokenizer.upper_bound`, no encoding) already proves that prompt + max_tokens
fits, and no tokens-per-minute limit or budget needs the exact number first, the bounds
stand in and the exact count (with its length check, a formality after the bound) is
handed back to run later: the proxy runs it while the backend works. Large requests are
rendered and counted exactly on a worker thread, off the event loop (`body_pool.py`);
"large" is the request body's size in bytes, which bounds everything the template renders
(messages, `tools`, documents, names), not the messages' text alone: a 4 MiB `tools` list
with a one-word message is rendered off the loop too. What to do with the counts
(length check or clamp, limits, headers) stays in the proxy.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.body_pool import LARGE_BODY_BYTES, run_for_body
from gateway.tokens import CountingTokenizer
from gateway.validation import ChatRequest, CompletionRequest, plan_tokens


async def count_prompts(
    tok: CountingTokenizer,
    req: ChatRequest | CompletionRequest,
    requested: int | None,
    max_len: int,
    param: str,
    *,
    exact_first: bool,
    body_bytes: int,
) -> tuple[list[str | int], list[int], Callable[[], list[int]] | None]:
    """What vLLM encodes (`CountingTokenizer.inputs`) and the exact counts; or, when upper
    bounds prove that prompt + output fits and `exact_first` is false (no limit needs
    the exact number), the bounds and a function that counts exactly later (and checks
    the length again). `body_bytes`: the size of the request body as received."""
    if body_bytes > LARGE_BODY_BYTES:

        def render_count() -> tuple[list[str | int], list[int]]:
            inputs, special = tok.inputs(req)
            return inputs, tok.count(inputs, special)

        inputs, counts = await run_for_body(body_bytes, render_count)
        return inputs, counts, None
    inputs, special = tok.inputs(req)
    bounds = tok.upper_bound(inputs, special)
    if exact_first or any(b + (requested or 1) > max_len for b in bounds):
        return inputs, tok.count(inputs, special), None

    def exact() -> list[int]:
        counts = tok.count(inputs, special)
        for c in counts:
            plan_tokens(c, requested, max_len, clamp=False, param=param)
        return counts

    return inputs, bounds, exact
