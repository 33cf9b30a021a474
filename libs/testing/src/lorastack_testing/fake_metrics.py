"""The fake vLLM's `/metrics` page: Prometheus text with vLLM 0.32's names."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

if TYPE_CHECKING:
    from lorastack_testing.fake_state import FakeState


def metrics_text(s: FakeState) -> bytes:
    """The fake's /metrics in Prometheus text: vLLM's KV-cache, queue, preemption, LoRA and
    cache-config series from the state."""
    r = CollectorRegistry()
    labels = {"model_name": s.models[0]["id"] if s.models else "none", "engine": "0"}
    names = list(labels)
    kv = min(1.0, s.generating * s.kv_per_request) if s.kv_per_request else s.kv_usage
    kv_name = "vllm:gpu_cache_usage_perc" if s.old_kv_name else "vllm:kv_cache_usage_perc"
    gauges = {
        kv_name: ("KV-cache usage. 1 means 100 percent usage.", kv),
        "vllm:num_requests_running": (
            "Number of requests in model execution batches.",
            s.running + s.generating,
        ),
        "vllm:num_requests_waiting": (
            "Number of requests waiting to be processed.",
            s.waiting + s.queued,
        ),
    }
    for name, (doc, value) in gauges.items():
        Gauge(name, doc, names, registry=r).labels(**labels).set(value)
    Counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        names,
        registry=r,
    ).labels(**labels).inc(s.preemptions)
    if s.num_gpu_blocks is not None:  # the labels vLLM 0.26 and 0.32 both give it
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "num_gpu_blocks_override", "engine"],
            registry=r,
        ).labels(
            block_size=str(s.block_size),
            num_gpu_blocks=str(s.num_gpu_blocks),
            num_gpu_blocks_override=str(s.num_gpu_blocks),
            engine="0",
        ).set(1)
    Gauge(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        registry=r,
    ).labels(
        max_lora=str(s.max_lora),
        waiting_lora_adapters=",".join(s.waiting_adapters),
        running_lora_adapters=",".join(s.running_adapters),
    ).set(time.time())
    return generate_latest(r)
