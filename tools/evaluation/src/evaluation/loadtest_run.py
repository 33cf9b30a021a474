"""`run_loadtest`: send streaming requests level by level and time every content chunk.

Reading top to bottom: build prompts, send `warmup` uncounted requests, then for each
level (concurrency levels first, then rates) start the /metrics sampler, run the level,
stop the sampler and summarise. A concurrency level keeps at most c requests in flight
(each worker sends its next request when the last one ends); a rate level sends requests
at seeded Poisson arrival times whatever is in flight (optionally capped). Every loop is
bounded by the number of requests and `max_duration_s`.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel, Field

from evaluation.endpoint import EndpointError, api_root, error_text, make_client
from evaluation.loadtest_config import LoadtestConfig
from evaluation.loadtest_prompts import (
    Prompt,
    Tokenizer,
    file_prompts,
    load_tokenizer,
    synthetic_prompts,
)
from evaluation.loadtest_stats import (
    FORMULAS,
    Level,
    LevelResult,
    RequestRecord,
    summarise_level,
)
from evaluation.prom import MetricsSampler, ServerPeaks
from lorastack.sse import BadEvent, EventReader, chunk_text


class LoadtestResult(BaseModel):
    """report.json's content; `records` (every request's timings) go to samples.jsonl."""

    created: str
    endpoint: str  # the URL the requests went to
    config: dict[str, Any]  # LoadtestConfig without the API key
    levels: list[LevelResult]
    formulas: dict[str, str] = FORMULAS
    notes: list[str]
    records: list[list[RequestRecord]] = Field(default=[], exclude=True)


def build_payload(config: LoadtestConfig, prompt: Prompt) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": config.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},  # usage tells the output token count
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension: exactly max_tokens tokens
    if config.endpoint == "chat":
        payload["messages"] = prompt.messages
    else:
        payload["prompt"] = prompt.text
    return payload


async def send_streaming(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    *,
    index: int,
    level_start: float,
    chat: bool,
    tokenizer: Tokenizer | None,
) -> RequestRecord:
    """One streamed request; the time of each content chunk is taken as its bytes arrive."""
    sent = time.perf_counter()
    rec = RequestRecord(index=index, sent_s=sent - level_start)
    text_parts: list[str] = []
    usage_tokens: int | None = None
    try:
        # identity encoding: raw bytes are the SSE text, read without httpx's line decoder
        # (it added ~10 ms per first chunk at 4 streams on a busy 2-core machine)
        async with client.stream(
            "POST", url, json=payload, headers={"Accept-Encoding": "identity"}
        ) as response:
            if response.status_code != 200:
                await response.aread()
                rec.error = f"HTTP {response.status_code}: {error_text(response)}"[:300]
                return rec
            reader = EventReader()
            async for raw in response.aiter_raw():
                now = time.perf_counter()  # all events of one read arrived now
                try:
                    events = reader.feed(raw)
                except BadEvent as e:
                    rec.error = str(e)
                    return rec
                for data in events:
                    if "error" in data and not data.get("choices"):
                        err = data["error"]
                        rec.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                        return rec
                    if piece := chunk_text(data, chat=chat):
                        rec.chunk_times_s.append(now - sent)
                        text_parts.append(piece)
                    if usage := data.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                        rec.prompt_tokens = usage.get("prompt_tokens")
                # after [DONE], read on to the end of the body: the connection stays reusable
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return rec
    if not rec.chunk_times_s:
        rec.error = "the stream ended without any content"
        return rec
    rec.ttft_s = rec.chunk_times_s[0]
    rec.e2e_s = rec.chunk_times_s[-1]
    if usage_tokens:
        rec.output_tokens, rec.token_source = int(usage_tokens), "usage"
    elif tokenizer is not None:
        ids = tokenizer.encode("".join(text_parts), add_special_tokens=False)
        rec.output_tokens, rec.token_source = len(ids), "tokenizer"
    else:
        rec.output_tokens, rec.token_source = len(rec.chunk_times_s), "chunks"
    return rec


async def _run_level(
    client: httpx.AsyncClient,
    url: str,
    config: LoadtestConfig,
    level: Level,
    prompts: list[Prompt],
    tokenizer: Tokenizer | None,
    level_index: int,
) -> tuple[list[RequestRecord], float]:
    chat = config.endpoint == "chat"
    n = config.requests
    start = time.perf_counter()
    deadline = start + config.max_duration_s
    records: list[RequestRecord] = []

    async def one(i: int) -> None:
        payload = build_payload(config, prompts[i % len(prompts)])
        records.append(
            await send_streaming(
                client, url, payload, index=i, level_start=start, chat=chat, tokenizer=tokenizer
            )
        )

    if level.kind == "concurrency":
        queue = iter(range(n))

        async def worker() -> None:
            for i in queue:  # shared iterator: each index is taken once
                if time.perf_counter() > deadline:
                    return
                await one(i)

        await asyncio.gather(*(worker() for _ in range(int(level.value))))
    else:
        rng = np.random.default_rng(config.seed + 1000 * level_index)
        arrivals = np.cumsum(rng.exponential(1.0 / level.value, size=n))  # seconds
        arrivals -= arrivals[0]  # the first request goes at once
        gate = asyncio.Semaphore(config.max_concurrency or n)
        tasks = []

        async def gated(i: int) -> None:
            async with gate:
                await one(i)

        for i, at in enumerate(arrivals):
            delay = start + float(at) - time.perf_counter()
            if start + float(at) > deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(i)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    records.sort(key=lambda r: r.index)
    return records, duration


def make_prompts(
    config: LoadtestConfig, tokenizer: Tokenizer | None, level_index: int
) -> list[Prompt]:
    chat = config.endpoint == "chat"
    if config.prompts_file is not None:
        return file_prompts(config.prompts_file, chat)
    return synthetic_prompts(
        config.requests, config.input_len, config.seed + level_index, tokenizer, chat
    )


async def run_loadtest_async(config: LoadtestConfig, *, log: Any = print) -> LoadtestResult:
    root = api_root(config.base_url)
    url = root + ("/chat/completions" if config.endpoint == "chat" else "/completions")
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    levels = [Level(kind="concurrency", value=c) for c in config.concurrency]
    levels += [Level(kind="rate", value=r) for r in config.rates]
    key = config.api_key.get_secret_value() if config.api_key else None
    biggest = max([*config.concurrency, config.max_concurrency or 0, config.requests])
    results: list[LevelResult] = []
    all_records: list[list[RequestRecord]] = []
    async with make_client(key, config.timeout_s, max_connections=biggest + 2) as client:
        if config.warmup:
            warm = make_prompts(config, tokenizer, level_index=10_000)
            for i in range(config.warmup):
                rec = await send_streaming(
                    client, url, build_payload(config, warm[i % len(warm)]), index=i,
                    level_start=time.perf_counter(), chat=config.endpoint == "chat", tokenizer=tokenizer,
                )  # fmt: skip
                if rec.error:
                    raise EndpointError(
                        f"the warm-up request to {url} failed: {rec.error}",
                        "check --base-url, --model and the API key",
                    )
        for li, level in enumerate(levels):
            prompts = make_prompts(config, tokenizer, li)
            sampler = None
            if config.metrics_url:
                sampler = MetricsSampler(config.metrics_url, client, config.metrics_interval_s)
                await sampler.start()
            log(f"level {level.label}: {config.requests} requests ...")
            records, duration = await _run_level(client, url, config, level, prompts, tokenizer, li)
            peaks: ServerPeaks | None = await sampler.stop() if sampler else None
            result = summarise_level(
                level, records, duration,
                slo_ttft_ms=config.slo_ttft_ms, slo_tpot_ms=config.slo_tpot_ms, server=peaks,
            )  # fmt: skip
            results.append(result)
            all_records.append(records)
            log(
                f"  {result.completed}/{result.requests} ok in {duration:.1f} s, "
                f"{result.output_tokens_per_s:.1f} output tok/s"
            )
    return LoadtestResult(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        endpoint=url,
        config=config.model_dump(mode="json", exclude={"api_key"}),
        levels=results,
        notes=_notes(config, results),
        records=all_records,
    )


def _notes(config: LoadtestConfig, results: list[LevelResult]) -> list[str]:
    notes = []
    if config.prompts_file is None:
        if config.tokenizer:
            notes.append(
                f"synthetic prompts: user text of exactly ~{config.input_len} tokens by the "
                "tokenizer given (the chat template adds its own)"
            )
        else:
            notes.append(
                f"synthetic prompts: {config.input_len} words, APPROXIMATELY {config.input_len} "
                "tokens (no --tokenizer given)"
            )
    sources = {s for r in results for s in r.token_sources}
    if "chunks" in sources:
        notes.append(
            "some output token counts are content-chunk counts (no usage field, no tokenizer): "
            "they undercount when a chunk carries several tokens"
        )
    if config.metrics_url is None:
        notes.append("no --metrics-url: KV-cache, waiting and preemption figures not sampled")
    return notes


def run_loadtest(config: LoadtestConfig, *, log: Any = print) -> LoadtestResult:
    """Blocking wrapper of `run_loadtest_async`."""
    return asyncio.run(run_loadtest_async(config, log=log))
