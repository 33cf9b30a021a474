"""A backend's series are forgotten in one place: `GatewayMetrics.forget_backend` drops every
series labelled by that backend, so a gauge added to metrics.py cannot outlive a replica
that left (its last value would stay in every sum over backends)."""

from __future__ import annotations

import contextlib

from prometheus_client import Gauge

from gateway.metrics import GatewayMetrics
from gateway.scrape import BackendMetrics


def _backends_in(metrics: GatewayMetrics) -> set[str]:
    text = metrics.render().decode()
    return {
        line.split('backend="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if not line.startswith("#") and 'backend="' in line
    }


def test_every_gauge_of_one_label_is_forgotten_with_a_backend() -> None:
    """A gauge labelled by a backend that `per_backend` misses would keep its series."""
    metrics = GatewayMetrics()
    url = "http://a:8000"
    for gauge in (v for v in vars(metrics).values() if isinstance(v, Gauge)):
        with contextlib.suppress(ValueError):  # no labels, or more than one
            gauge.labels(url).set(1)
    assert _backends_in(metrics) == {url}
    metrics.forget_backend(url)
    assert _backends_in(metrics) == set()


def test_a_forgotten_backend_leaves_no_series() -> None:
    metrics = GatewayMetrics()
    for url in ("http://a:8000", "http://b:8000"):
        metrics.mirror_backend(url, True, BackendMetrics(kv_usage=0.5, kv_capacity_tokens=4096))
        metrics.backend_inflight.labels(url).set(2)
        metrics.backend_kv_claimed.labels(url).set(64)
        metrics.upstream_errors.labels(url, "connect").inc()
    assert _backends_in(metrics) == {"http://a:8000", "http://b:8000"}
    metrics.forget_backend("http://a:8000")
    assert _backends_in(metrics) == {"http://b:8000"}
    metrics.forget_backend("http://a:8000")  # twice: nothing left to drop, no error
