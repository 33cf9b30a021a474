"""Server metrics during a load level: parse Prometheus text, sample `/metrics`, summarise.

Reads the gauges and counters vLLM exposes (names as vLLM 0.32 writes them):

    vllm:kv_cache_usage_perc     gauge 0..1 (older servers: vllm:gpu_cache_usage_perc); peak = max
    vllm:num_requests_waiting    gauge; peak = max over samples of the sum over series
    vllm:num_preemptions_total   counter; preemptions = last sample - first sample

Parsing is pure (prometheus_client's parser); `MetricsSampler` is the only part doing I/O
(GET every `interval_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"

Sample = dict[str, list[float]]  # metric name -> values of its series


def parse_prometheus(text: str) -> Sample:
    """Sample name -> the values of all its series (labels dropped), by prometheus_client's
    text parser (the one the gateway and the inference service use). A page that stops
    parsing part-way (a scrape cut off) keeps the metric families before the bad line."""
    out: Sample = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isnan(s.value):
                    out.setdefault(s.name, []).append(float(s.value))
    except ValueError:
        pass
    return out


class ServerPeaks(BaseModel):
    """The server's peaks over a level from its /metrics: KV usage, queues, preemptions."""

    samples: int  # /metrics scrapes that answered
    peak_kv_cache_usage: float | None  # 0..1
    peak_waiting: float | None  # requests
    peak_running: float | None  # requests
    preemptions: float | None  # counter delta over the level


def summarise_samples(samples: list[Sample]) -> ServerPeaks:
    """The peaks of the scraped samples; preemptions are the counter's change from the first
    sample to the last."""

    def peak(names: tuple[str, ...], combine: str) -> float | None:
        values = []
        for s in samples:
            for name in names:
                if name in s:
                    values.append(max(s[name]) if combine == "max" else sum(s[name]))
                    break
        return max(values) if values else None

    counts = [sum(s[PREEMPTIONS]) for s in samples if PREEMPTIONS in s]
    return ServerPeaks(
        samples=len(samples),
        peak_kv_cache_usage=peak(KV_USAGE, "max"),
        peak_waiting=peak((WAITING,), "sum"),
        peak_running=peak((RUNNING,), "sum"),
        preemptions=(counts[-1] - counts[0]) if len(counts) >= 2 else None,
    )


class MetricsSampler:
    """Scrape `url` every `interval_s` seconds between `start()` and `stop()`."""

    def __init__(self, url: str, client: httpx.AsyncClient, interval_s: float = 0.5) -> None:
        self.url = url
        self.client = client
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def scrape(self) -> None:
        """Scrape /metrics once; a failure is counted, not raised."""
        try:
            r = await self.client.get(self.url, timeout=5.0)
            if r.status_code == 200:
                self.samples.append(parse_prometheus(r.text))
                return
        except httpx.HTTPError:
            pass
        self.failures += 1

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def start(self) -> None:
        """Scrape once, then keep scraping in the background."""
        await self.scrape()  # the counter's value before the level
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> ServerPeaks:
        """Stop the background scrapes, scrape once more and return the peaks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scrape()  # and after it
        return summarise_samples(self.samples)
