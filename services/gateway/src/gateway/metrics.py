"""The gateway's Prometheus metrics, in a registry of its own per app (never the global one).

Per-backend gauges mirror what the last scrape of that backend's `/metrics` said; the
gateway's own histograms time every proxied request as its client saw it.

With `--workers N` each worker writes its values to files in `multiprocess_dir`
(prometheus_client's multiprocess mode: `PROMETHEUS_MULTIPROC_DIR`, which the parent sets
before any worker imports the library) and /metrics, served by any worker, reads them
all: counters and histograms summed over the workers (a dead worker's counts stay in),
requests in flight summed over the live ones, and a gauge that every worker sets to the
same thing (a scrape, the shared KV claims) as the live worker that set it last; a
series of a backend the gateway forgot is left out (`render`), and what the workers
share exactly (discovery's counts) is read once from the shared counts (`add_collector`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.scrape import BackendMetrics

REJECTION_REASONS = (
    "context_length",
    "unknown_model",
    "unauthorized",
    "rate_limited",
    "overloaded",
    "invalid_request",
    "model_not_allowed",
    "budget_exhausted",
    "adapter_loading",
)
# Kinds of failed upstream attempts; each backend's series start at 0, so the dashboard's
# errors panel shows 0 instead of "No data" while nothing failed.
UPSTREAM_ERROR_KINDS = ("connect", "status_5xx", "timeout", "broken_stream")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# a gauge every worker sets alike (from its scrape, or the shared counts): the live
# worker's that set it last
_SCRAPED: Final = "livemostrecent"


class RouteSeries:
    """The histograms of one (model, route), bound once: `.labels()` per request cost a
    lock and a label check each (bench/gateway/history.md)."""

    __slots__ = ("_duration", "_labels", "_statuses", "output_tokens", "tpot", "ttft")

    def __init__(self, m: GatewayMetrics, model: str, route: str) -> None:
        self._duration = m.duration
        self._labels = (model, route)
        self._statuses: dict[str, Histogram] = {}
        self.ttft = m.ttft.labels(model, route)
        self.tpot = m.tpot.labels(model, route)
        self.output_tokens = m.output_tokens.labels(model, route)

    def duration(self, status: str) -> Histogram:
        """The request duration histogram for `status`, bound on first use."""
        child = self._statuses.get(status)
        if child is None:
            child = self._statuses[status] = self._duration.labels(*self._labels, status)
        return child


class GatewayMetrics:
    """The gateway's Prometheus metrics in their own registry; with `multiprocess_dir`, every
    worker's values."""

    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir  # set: every worker's values (`render`)
        self._series: dict[tuple[str, str], RouteSeries] = {}
        self._collectors: list[Collector] = []  # rendered once, not per worker
        self.registry = r = CollectorRegistry(auto_describe=True)

        def backend_gauge(name: str, doc: str) -> Gauge:
            """A gauge labelled by a backend alone, set alike by every worker (a scrape)."""
            return Gauge(name, doc, ["backend"], multiprocess_mode=_SCRAPED, registry=r)

        def key_counter(name: str, doc: str, *labels: str) -> Counter:
            """A counter labelled by a key's name (never its secret), then by `labels`."""
            return Counter(name, doc, ["key", *labels], registry=r)

        self.backend_up = backend_gauge(
            "lorastack_gateway_backend_up",
            "1 when the last scrape of the backend succeeded",
        )
        self.backend_kv = backend_gauge(
            "lorastack_gateway_backend_kv_cache_usage",
            "the backend's vllm:kv_cache_usage_perc (0..1) at the last scrape",
        )
        self.backend_running = backend_gauge(
            "lorastack_gateway_backend_requests_running",
            "the backend's vllm:num_requests_running at the last scrape",
        )
        self.backend_waiting = backend_gauge(
            "lorastack_gateway_backend_requests_waiting",
            "the backend's vllm:num_requests_waiting at the last scrape",
        )
        self.backend_preemptions = backend_gauge(
            "lorastack_gateway_backend_preemptions",
            "the backend's vllm:num_preemptions_total at the last scrape",
        )
        self.backend_inflight = backend_gauge(
            "lorastack_gateway_backend_inflight",
            "requests this gateway has open on the backend",
        )
        self.backend_kv_claimed = backend_gauge(
            "lorastack_gateway_backend_kv_claimed_tokens",
            "KV cache the requests this gateway has open on the backend can take: prompt +"
            " max output of each sequence, in whole blocks (its KV-cache admission counts"
            " these against vllm:cache_config_info)",
        )
        self.kv_admission_waiting = Gauge(
            "lorastack_gateway_kv_admission_waiting",
            "requests in line for KV-cache room, admitted first come first served"
            " (kv_admit_wait_s at most)",
            multiprocess_mode=_SCRAPED,
            registry=r,
        )
        self.backend_kv_capacity = backend_gauge(
            "lorastack_gateway_backend_kv_capacity_tokens",
            "the backend's KV cache in tokens (vllm:cache_config_info), NaN when not reported",
        )
        self.backend_weight = backend_gauge(
            "lorastack_gateway_backend_routing_weight",
            "the backend's static routing weight (backend_weights; 1 when unlisted)",
        )
        labels = ["model", "route"]
        self.duration = Histogram(
            "lorastack_gateway_request_duration_seconds",
            "end-to-end time of proxied requests, from the request to the last byte (seconds)",
            [*labels, "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "lorastack_gateway_time_to_first_token_seconds",
            "time from the request to the first streamed event from the backend (seconds; streaming requests)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "lorastack_gateway_time_per_output_token_seconds",
            "TPOT = (end-to-end - TTFT) / (output tokens - 1), seconds; streaming requests with >= 2 output tokens",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "lorastack_gateway_output_tokens",
            "completion tokens per request, from the backend's usage",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "lorastack_gateway_rejections_total",
            "requests the gateway refused before reaching a backend, by reason",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "lorastack_gateway_upstream_errors_total",
            "failed upstream attempts, by kind (connect, status_5xx, timeout, broken_stream)",
            ["backend", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "lorastack_gateway_retries_total",
            "upstream attempts repeated before the first byte",
            registry=r,
        )
        self.clamped = Counter(
            "lorastack_gateway_clamped_total",
            "requests whose max_tokens the gateway lowered (clamp mode)",
            registry=r,
        )
        self.inflight = Gauge(
            "lorastack_gateway_inflight_requests",
            "requests being proxied now",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.key_requests = key_counter(
            "lorastack_gateway_key_requests_total",
            "requests admitted (past auth, model check and limits), by key name",
        )
        self.key_prompt_tokens = key_counter(
            "lorastack_gateway_key_prompt_tokens_total",
            "prompt tokens of answered requests, by key name (the backend's usage)",
        )
        self.key_completion_tokens = key_counter(
            "lorastack_gateway_key_completion_tokens_total",
            "completion tokens of answered requests, by key name (the backend's usage)",
        )
        self.key_rejections = key_counter(
            "lorastack_gateway_key_rejections_total",
            "requests of a known key the gateway refused, by key name and reason",
            "reason",
        )
        self.redis_up = Gauge(
            "lorastack_gateway_redis_up",
            "1 while the Redis holding the shared per-key limits answers; 0: this replica"
            " counts its own limits until it answers again (exported only with redis_url)",
            ["redis"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.redis_errors = Counter(
            "lorastack_gateway_redis_errors_total",
            "Redis calls for per-key limits that failed, by operation (admit, refund); the"
            " request was checked against this replica's own limits instead",
            ["op"],
            registry=r,
        )
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        # every series labelled by a backend alone: `forget_backend` drops them all
        self.per_backend: tuple[Gauge, ...] = (
            self.backend_up,
            self.backend_kv,
            self.backend_running,
            self.backend_waiting,
            self.backend_preemptions,
            self.backend_inflight,
            self.backend_kv_claimed,
            self.backend_kv_capacity,
            self.backend_weight,
        )

    def series(self, model: str, route: str) -> RouteSeries:
        """The request histograms of `model` on `route` (models come from the backends'
        catalog, so the cache is as bounded as the label sets themselves)."""
        found = self._series.get((model, route))
        if found is None:
            found = self._series[(model, route)] = RouteSeries(self, model, route)
        return found

    def mirror_backend(self, url: str, up: bool, m: BackendMetrics | None) -> None:
        """Set a backend's gauges from its last scrape (`m`; None: only whether it is up)."""
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(url, kind)
        self.backend_up.labels(url).set(1 if up else 0)
        if m is None:
            return
        self.backend_kv.labels(url).set(m.kv_usage if m.kv_usage is not None else float("nan"))
        self.backend_running.labels(url).set(m.running)
        self.backend_waiting.labels(url).set(m.waiting)
        self.backend_preemptions.labels(url).set(m.preemptions)
        cap = m.kv_capacity_tokens
        self.backend_kv_capacity.labels(url).set(float("nan") if cap is None else cap)

    def forget_backend(self, url: str) -> None:
        """Drop a forgotten backend's series (a gauge would keep its last value): the one
        place that knows which series a backend has. With `--workers N` `remove` does
        nothing (the values live in every worker's files): `render` then leaves out the
        series of backends no longer known."""
        for gauge in self.per_backend:
            with contextlib.suppress(KeyError):
                gauge.remove(url)
        for kind in UPSTREAM_ERROR_KINDS:
            with contextlib.suppress(KeyError):
                self.upstream_errors.remove(url, kind)

    def add_collector(self, collector: Collector) -> None:
        """A collector of values every worker reads alike (the shared counts): rendered
        once, not summed over the workers' files."""
        self._collectors.append(collector)
        self.registry.register(collector)

    def render(self, backends: Collection[str] | None = None) -> bytes:
        """Prometheus text: this process's metrics, or every worker's (`multiprocess_dir`),
        where a series labelled with a backend not in `backends` (None: any) is left out:
        the workers' files keep a forgotten backend's series, which `remove` cannot drop."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        every = CollectorRegistry(auto_describe=False)
        every.register(_KnownBackends(MultiProcessCollector(None, str(self.multiprocess_dir)),
                                      None if backends is None else frozenset(backends)))  # fmt: skip
        for collector in self._collectors:
            every.register(collector)
        return generate_latest(every)


class _KnownBackends(Collector):
    """The workers' metrics without the series of backends the gateway forgot."""

    def __init__(self, inner: MultiProcessCollector, backends: frozenset[str] | None) -> None:
        self.inner = inner
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            keep = self.backends
            if keep is not None:
                family.samples = [
                    s for s in family.samples if s.labels.get("backend", "") in keep
                    or "backend" not in s.labels
                ]  # fmt: skip
            yield family
