"""Load-test figures from per-request timings: pure functions, no I/O.

Definitions (all times from the client's clock, `time.perf_counter`):

    TTFT   first content chunk - request sent
    E2E    last content chunk - request sent
    TPOT   (E2E - TTFT) / (output tokens - 1)      requests with > 1 output token
    ITL    gaps between consecutive content chunks  (all requests pooled)
    output tokens/s   sum(output tokens) / level duration
    requests/s        successful requests / level duration
    goodput           successful requests meeting every SLO given / level duration
    level duration    first request sent -> last request finished

Percentiles: numpy linear interpolation (as `vllm bench serve`).
"""

from __future__ import annotations

import itertools
from typing import Literal

import numpy as np
from pydantic import BaseModel

from evaluation.prom import ServerPeaks

FORMULAS = {
    "TTFT": "time of the first content chunk - time the request was sent",
    "E2E": "time of the last content chunk - time the request was sent",
    "TPOT": "(E2E - TTFT) / (output tokens - 1), requests with more than one output token",
    "ITL": "time between two consecutive content chunks (all requests pooled)",
    "out tok/s": "sum of output tokens / level duration (first send -> last finish)",
    "req/s": "successful requests / level duration",
    "goodput": "successful requests with TTFT <= SLO and TPOT <= SLO / level duration",
    "KV peak": "max of vllm:kv_cache_usage_perc sampled during the level (0..1)",
    "wait peak": "max of vllm:num_requests_waiting sampled during the level",
    "preempt": "vllm:num_preemptions_total after - before the level",
}

TokenSource = Literal["usage", "tokenizer", "chunks"]


class RequestRecord(BaseModel):
    """One request's timings, output token count and error, as the client saw them."""

    index: int
    sent_s: float  # seconds since the level started
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = []  # each content chunk, seconds after sending
    output_tokens: int = 0
    token_source: TokenSource = "chunks"
    prompt_tokens: int | None = None  # from usage
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)]


class Percentiles(BaseModel):
    """How many values, their mean and their p50/p90/p99 (None when there are none)."""

    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


def percentiles(values: list[float], scale: float = 1.0) -> Percentiles:
    """The `Percentiles` of `values`, each multiplied by `scale`."""
    if not values:
        return Percentiles(n=0, mean=None, p50=None, p90=None, p99=None)
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Percentiles(
        n=a.size, mean=float(a.mean()), p50=float(p50), p90=float(p90), p99=float(p99)
    )


class Level(BaseModel):
    """One load level: a number of requests in flight, or an arrival rate."""

    kind: Literal["concurrency", "rate"]
    value: float  # requests in flight, or requests per second

    @property
    def label(self) -> str:
        return f"c={self.value:g}" if self.kind == "concurrency" else f"{self.value:g} req/s"


class LevelResult(BaseModel):
    """One level's figures: counts, latency percentiles, throughput, goodput under the SLOs,
    the server's peaks and the client's CPU use."""

    level: Level
    requests: int
    completed: int
    errors: int
    error_examples: list[str]
    duration_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    goodput_rps: float | None  # None when no SLO was given
    good_fraction: float | None
    token_sources: dict[str, int]  # how output tokens were counted: usage/tokenizer/chunks
    mean_prompt_tokens: float | None  # from usage (chat template included)
    server: ServerPeaks | None
    # CPU seconds per second of the level of the busiest client process (1.0: a full core)
    client_busy: float | None = None


def _within_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a completed request met both SLOs (a None SLO is met)."""
    ttft_ms = (r.ttft_s or 0.0) * 1000
    tpot_ms = (r.tpot_s or 0.0) * 1000  # one-token answers have no TPOT: they pass
    return (slo_ttft_ms is None or ttft_ms <= slo_ttft_ms) and (
        slo_tpot_ms is None or tpot_ms <= slo_tpot_ms
    )


def summarise_level(
    level: Level,
    records: list[RequestRecord],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    server: ServerPeaks | None = None,
    client_busy: float | None = None,
) -> LevelResult:
    """The figures of one level from its records; goodput counts the requests within both
    SLOs (None when no SLO is given)."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    goodput = good_frac = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(_within_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
        goodput = good / duration
        good_frac = good / len(records) if records else 0.0
    sources: dict[str, int] = {}
    for r in ok:
        sources[r.token_source] = sources.get(r.token_source, 0) + 1
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return LevelResult(
        level=level,
        requests=len(records),
        completed=len(ok),
        errors=len(errors),
        error_examples=sorted({r.error for r in errors})[:3],
        duration_s=duration_s,
        ttft_ms=percentiles([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        tpot_ms=percentiles([t for r in ok if (t := r.tpot_s) is not None], 1000),
        itl_ms=percentiles([g for r in ok for g in r.itls_s], 1000),
        e2e_ms=percentiles([r.e2e_s for r in ok if r.e2e_s is not None], 1000),
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / duration,
        requests_per_s=len(ok) / duration,
        goodput_rps=goodput,
        good_fraction=good_frac,
        token_sources=sources,
        mean_prompt_tokens=(sum(prompt_tokens) / len(prompt_tokens)) if prompt_tokens else None,
        server=server,
        client_busy=client_busy,
    )
