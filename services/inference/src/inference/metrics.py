"""The supervisor's Prometheus metrics, read from the supervisor at scrape time.

A collector in a registry of its own per app (never the global registry): our KV-cache
estimate next to vLLM's reported figures, readiness, restarts, loaded adapters, their
parity with what was trained, the labels they follow and the deployment's declared adapters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference.declared_adapters import AdapterReconciler
from inference.label_follow import LabelFollower
from inference.parity import Outcome, ParityNoReference, ParityRecord, ParityVerdict
from inference.supervisor import Supervisor


class SupervisorCollector(Collector):
    """Collects the supervisor's metrics from its state at each scrape."""

    def __init__(
        self,
        supervisor: Supervisor,
        follower: LabelFollower | None = None,
        reconciler: AdapterReconciler | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.follower = follower
        self.reconciler = reconciler

    def collect(self) -> Iterator[Metric]:
        """The supervisor's metrics, read at each scrape."""
        sup = self.supervisor
        yield _single(
            GaugeMetricFamily,
            "lorastack_inference_ready",
            "1 when vLLM is loaded and answered a warm-up request",
            1.0 if sup.ready else 0.0,
        )
        yield _single(
            CounterMetricFamily,
            "lorastack_inference_restarts",
            "times vLLM was started again after it exited",
            float(sup.history.restarts),
        )
        yield from kv_metrics(sup.kv.comparison())
        yield _single(
            GaugeMetricFamily,
            "lorastack_inference_adapters_loaded",
            "LoRA adapters served beside the model",
            float(len(sup.adapters)),
        )
        yield from parity_metrics(sup.parity.results(), sup.parity.outcomes)
        if self.follower is not None:
            yield _single(
                CounterMetricFamily,
                "lorastack_inference_label_switches",
                "versions switched in place because a followed NAME@LABEL moved",
                float(self.follower.switches),
            )
            yield _single(
                GaugeMetricFamily,
                "lorastack_inference_label_errors",
                "followed labels whose new target could not be served (see /status labels)",
                float(len(self.follower.errors)),
            )
        if self.reconciler is not None:
            yield from declared_metrics(self.reconciler)


def _single(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, value: float
) -> Metric:
    """A metric of one unlabelled series."""
    metric = family(name, doc)
    metric.add_metric([], value)
    return metric


def kv_metrics(kv: dict[str, Any]) -> Iterator[Metric]:
    """The KV cache's capacity in tokens and in requests at once, by source (our estimate,
    and what vLLM's log and metrics reported: the kv_report comparison), and our estimate's
    bytes per token and whether the configured load fits."""
    est, log, scraped = kv["estimate"], kv["vllm_log"], kv["vllm_metrics"]
    tokens = GaugeMetricFamily(
        "lorastack_inference_kv_cache_tokens",
        "KV-cache capacity in tokens: our estimate and what vLLM reported",
        labels=["source"],
    )
    tokens.add_metric(["estimate"], float(est["capacity_tokens"]))
    if log:
        tokens.add_metric(["vllm_log"], float(log["capacity_tokens"]))
    if scraped and scraped["capacity_tokens"] is not None:
        tokens.add_metric(["vllm_metrics"], float(scraped["capacity_tokens"]))
    yield tokens
    concurrency = GaugeMetricFamily(
        "lorastack_inference_kv_max_concurrency",
        "requests of max-model-len tokens the KV cache holds at once",
        labels=["source"],
    )
    concurrency.add_metric(["estimate"], float(est["max_concurrency"]))
    if log and log["max_concurrency"] is not None:
        concurrency.add_metric(["vllm_log"], float(log["max_concurrency"]))
    yield concurrency
    yield _single(
        GaugeMetricFamily,
        "lorastack_inference_kv_bytes_per_token",
        "estimated KV-cache bytes per token",
        float(est["bytes_per_token"]),
    )
    yield _single(
        GaugeMetricFamily,
        "lorastack_inference_kv_fits",
        "1 when max-num-seqs x typical request tokens fit the estimated KV cache",
        1.0 if est["fits"] else 0.0,
    )


def parity_metrics(
    results: Mapping[str, ParityRecord], outcomes: Mapping[Outcome, int]
) -> Iterator[Metric]:
    """Per served model and adapter: did its answers match its parity reference
    (lorastack.parity), by how much, and how long the check took; a check that could not
    run counts as not matching (its model is served unchecked, or refused). The checks so
    far by outcome. Nothing per model for one without a reference."""
    ok = GaugeMetricFamily(
        "lorastack_inference_parity_ok",
        "1 when what vLLM serves matched its parity reference (recorded where it was "
        "trained), 0 when it did not or its check could not run",
        labels=["model"],
    )
    top1 = GaugeMetricFamily(
        "lorastack_inference_parity_top1_agreement",
        "fraction of the reference's tokens that are still vLLM's most likely token",
        labels=["model"],
    )
    delta = GaugeMetricFamily(
        "lorastack_inference_parity_max_logprob_delta",
        "largest |log-prob served - log-prob trained| of a reference token, nats",
        labels=["model"],
    )
    seconds = GaugeMetricFamily(
        "lorastack_inference_parity_check_seconds",
        "how long the last parity check of the model took, seconds",
        labels=["model"],
    )
    for name, record in sorted(results.items()):
        if isinstance(record, ParityNoReference):
            continue  # nothing was checked
        ok.add_metric([name], 1.0 if record.ok else 0.0)  # a check that could not run: 0
        if isinstance(record, ParityVerdict):
            top1.add_metric([name], record.top1_agreement)
            delta.add_metric([name], record.max_abs_logprob_delta)
        seconds.add_metric([name], record.seconds)
    yield from (ok, top1, delta, seconds)
    checks = CounterMetricFamily(
        "lorastack_inference_parity_checks",
        "parity checks by outcome: passed, refused, warned (failed, served under warn), "
        "error_refused / error_served (could not run), no_reference",
        labels=["outcome"],
    )
    for outcome, n in outcomes.items():
        checks.add_metric([outcome], float(n))
    yield checks


def declared_metrics(rec: AdapterReconciler) -> Iterator[Metric]:
    """The gauges and counters of the declared-adapters reconciler."""
    yield _single(
        GaugeMetricFamily,
        "lorastack_inference_declared_adapters",
        "adapters the deployment's declaration in the store lists (as last read)",
        float(len(rec.declaration.adapters)),
    )
    changes = CounterMetricFamily(
        "lorastack_inference_declared_changes",
        "adapters loaded or unloaded here to match the deployment's declaration",
        labels=["change"],
    )
    changes.add_metric(["load"], float(rec.loads))
    changes.add_metric(["unload"], float(rec.unloads))
    yield changes
    yield _single(
        GaugeMetricFamily,
        "lorastack_inference_declared_errors",
        "declared adapters this replica cannot serve, or 1 for an unreadable store"
        " (see /status declared.errors)",
        float(len(rec.errors)),
    )


def build_registry(
    supervisor: Supervisor,
    follower: LabelFollower | None = None,
    reconciler: AdapterReconciler | None = None,
) -> CollectorRegistry:
    """A registry of its own holding the supervisor's collector."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SupervisorCollector(supervisor, follower, reconciler))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
