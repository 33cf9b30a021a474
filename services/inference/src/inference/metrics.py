"""The supervisor's Prometheus metrics, read from the supervisor at scrape time.

A collector in a registry of its own per app (never the global registry): our KV-cache
estimate next to vLLM's reported figures, readiness, restarts and loaded adapters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference.supervisor import Supervisor


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

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


def build_registry(supervisor: Supervisor) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SupervisorCollector(supervisor))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
