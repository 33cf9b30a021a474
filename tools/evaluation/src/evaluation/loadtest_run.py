"""`run_loadtest`: send streaming requests level by level and time every content chunk.

Reading top to bottom: build prompts, send `warmup` uncounted requests, then for each
level (concurrency levels first, then rates) start the /metrics sampler, run the level,
stop the sampler and summarise. A concurrency level keeps at most c requests in flight
(each worker sends its next request when the last one ends); a rate level sends requests
at seeded Poisson arrival times whatever is in flight (optionally capped). Every loop is
bounded by the number of requests and `max_duration_s`. With `processes` > 1 each level is
cut into shares that client processes send from one start (`loadtest_clients`); a note
says when the busiest sender used most of a core (then the client was the limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel, Field

from evaluation.endpoint import EndpointError, api_root, make_client
from evaluation.loadtest_clients import (
    ClientProcesses,
    send_share,
    send_streaming,
    split_level,
)
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

# CPU seconds per second of a level, busiest sender: above it, the load generator is a
# suspect (a sender near a full core made its figures vary from run to run, one well under
# it did not: bench/serving/README.md)
CLIENT_BUSY = 0.8


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
    """The streaming request body for `prompt`, asking for usage (and exactly `output_len`
    tokens with `ignore_eos`)."""
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


async def _run_level(
    client: httpx.AsyncClient,
    procs: ClientProcesses | None,
    url: str,
    config: LoadtestConfig,
    level: Level,
    prompts: list[Prompt],
    tokenizer: Tokenizer | None,
    level_index: int,
) -> tuple[list[RequestRecord], float, float]:
    """(records in index order, duration, the busiest sender's CPU seconds per second of the
    level): sent from here with `client`, or by `procs`, one share each."""
    payloads = [build_payload(config, prompts[i % len(prompts)]) for i in range(config.requests)]
    arrivals = None
    if level.kind == "rate":
        rng = np.random.default_rng(config.seed + 1000 * level_index)
        at = np.cumsum(rng.exponential(1.0 / level.value, size=config.requests))  # seconds
        arrivals = [float(x) for x in at - at[0]]  # the first request goes at once
    shares = split_level(
        level, payloads, procs.size if procs else 1, arrivals=arrivals,
        max_concurrency=config.max_concurrency,
    )  # fmt: skip
    if procs is not None:  # a thread waits for them: this loop samples /metrics meanwhile
        start, done = await asyncio.to_thread(procs.run, shares, config.max_duration_s)
    else:
        start = time.perf_counter()
        done = [
            await send_share(
                client, url, shares[0], start=start, deadline=start + config.max_duration_s,
                chat=config.endpoint == "chat", tokenizer=tokenizer,
            )
        ]  # fmt: skip
    duration = max(d.end for d in done) - start
    records = sorted((r for d in done for r in d.records), key=lambda r: r.index)
    return records, duration, max(d.cpu_s for d in done) / max(duration, 1e-9)


def make_prompts(
    config: LoadtestConfig, tokenizer: Tokenizer | None, level_index: int
) -> list[Prompt]:
    """A level's prompts: the prompts file when given, else synthetic ones seeded per level."""
    chat = config.endpoint == "chat"
    if config.prompts_file is not None:
        return file_prompts(config.prompts_file, chat)
    return synthetic_prompts(
        config.requests, config.input_len, config.seed + level_index, tokenizer, chat
    )


async def run_loadtest_async(config: LoadtestConfig, *, log: Any = print) -> LoadtestResult:
    """Run every level (concurrency levels, then rate levels) after the warm-up and return the
    result with its per-request records."""
    root = api_root(config.base_url)
    url = root + ("/chat/completions" if config.endpoint == "chat" else "/completions")
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    levels = [Level(kind="concurrency", value=c) for c in config.concurrency]
    levels += [Level(kind="rate", value=r) for r in config.rates]
    key = config.api_key.get_secret_value() if config.api_key else None
    biggest = max([*config.concurrency, config.max_concurrency or 0, config.requests])
    results: list[LevelResult] = []
    all_records: list[list[RequestRecord]] = []
    procs = ClientProcesses(config.processes, config, url) if config.processes > 1 else None
    with procs or contextlib.nullcontext():
        async with make_client(key, config.timeout_s, max_connections=biggest + 2) as client:
            await _levels(client, procs, url, config, levels, tokenizer, results, all_records, log)
    return LoadtestResult(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        endpoint=url,
        config=config.model_dump(mode="json", exclude={"api_key"}),
        levels=results,
        notes=_notes(config, results),
        records=all_records,
    )


async def _levels(
    client: httpx.AsyncClient,
    procs: ClientProcesses | None,
    url: str,
    config: LoadtestConfig,
    levels: list[Level],
    tokenizer: Tokenizer | None,
    results: list[LevelResult],
    all_records: list[list[RequestRecord]],
    log: Any,
) -> None:
    """The warm-up, then each level with its /metrics sampler; appends to the lists."""
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
        records, duration, busy = await _run_level(
            client, procs, url, config, level, prompts, tokenizer, li
        )
        peaks: ServerPeaks | None = await sampler.stop() if sampler else None
        result = summarise_level(
            level, records, duration, slo_ttft_ms=config.slo_ttft_ms,
            slo_tpot_ms=config.slo_tpot_ms, server=peaks, client_busy=busy,
        )  # fmt: skip
        results.append(result)
        all_records.append(records)
        log(
            f"  {result.completed}/{result.requests} ok in {duration:.1f} s, "
            f"{result.output_tokens_per_s:.1f} output tok/s"
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
    busy = [r for r in results if r.client_busy is not None and r.client_busy >= CLIENT_BUSY]
    if busy:
        worst = max(busy, key=lambda r: r.client_busy or 0.0)
        notes.append(
            f"the load generator was busy {worst.client_busy:.0%} of a core at level"
            f" {worst.level.label} ({len(busy)} level(s) over {CLIENT_BUSY:.0%}): there the client"
            f" may be the limit, not the server; run again with --processes"
            f" {2 * config.processes} (one Python process streams a few thousand tokens a"
            " second at most)"
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
