"""The supervisor's Prometheus metrics, read from the supervisor at scrape time.

A collector in a registry of its own per app (never the global registry): our KV-cache
estimate next to vLLM's reported figures, readiness, restarts, loaded adapters and the
labels they follow.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference.label_follow import LabelFollower
from inference.supervisor import Supervisor


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor, follower: LabelFollower | None = None) -> None:
        self.supervisor = supervisor
        self.follower = follower

    def collect(self) -> Iterator[Metric]:
        sup = self.supervisor
        kv = sup.kv_comparison()
        est = kv["estimate"]
        ready = GaugeMetricFamily(
            "lorastack_inference_ready", "1 when vLLM is loaded and answered a warm-up request"
        )
        ready.add_metric([], 1.0 if sup.ready else 0.0)
        yield ready
        restarts = CounterMetricFamily(
            "lorastack_inference_restarts", "times vLLM was started again after it exited"
        )
        restarts.add_metric([], float(sup.restarts))
        yield restarts
        tokens = GaugeMetricFamily(
            "lorastack_inference_kv_cache_tokens",
            "KV-cache capacity in tokens: our estimate and what vLLM reported",
            labels=["source"],
        )
        tokens.add_metric(["estimate"], float(est["capacity_tokens"]))
        if kv["vllm_log"]:
            tokens.add_metric(["vllm_log"], float(kv["vllm_log"]["capacity_tokens"]))
        if kv["vllm_metrics"] and kv["vllm_metrics"]["capacity_tokens"] is not None:
            tokens.add_metric(["vllm_metrics"], float(kv["vllm_metrics"]["capacity_tokens"]))
        yield tokens
        conc = GaugeMetricFamily(
            "lorastack_inference_kv_max_concurrency",
            "requests of max-model-len tokens the KV cache holds at once",
            labels=["source"],
        )
        conc.add_metric(["estimate"], float(est["max_concurrency"]))
        if kv["vllm_log"] and kv["vllm_log"]["max_concurrency"] is not None:
            conc.add_metric(["vllm_log"], float(kv["vllm_log"]["max_concurrency"]))
        yield conc
        per_token = GaugeMetricFamily(
            "lorastack_inference_kv_bytes_per_token", "estimated KV-cache bytes per token"
        )
        per_token.add_metric([], float(est["bytes_per_token"]))
        yield per_token
        fits = GaugeMetricFamily(
            "lorastack_inference_kv_fits",
            "1 when max-num-seqs x typical request tokens fit the estimated KV cache",
        )
        fits.add_metric([], 1.0 if est["fits"] else 0.0)
        yield fits
        adapters = GaugeMetricFamily(
            "lorastack_inference_adapters_loaded", "LoRA adapters served beside the model"
        )
        adapters.add_metric([], float(len(sup.adapters)))
        yield adapters
        if self.follower is not None:
            switches = CounterMetricFamily(
                "lorastack_inference_label_switches",
                "versions switched in place because a followed NAME@LABEL moved",
            )
            switches.add_metric([], float(self.follower.switches))
            yield switches
            stuck = GaugeMetricFamily(
                "lorastack_inference_label_errors",
                "followed labels whose new target could not be served (see /status labels)",
            )
            stuck.add_metric([], float(len(self.follower.errors)))
            yield stuck


def build_registry(
    supervisor: Supervisor, follower: LabelFollower | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SupervisorCollector(supervisor, follower))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
