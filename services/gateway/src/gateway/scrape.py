"""Read a vLLM backend: parse its Prometheus `/metrics` text and its `/v1/models` list.

`parse_metrics` and `parse_models` are pure; `scrape_backend` does the two GETs;
`probe_embeddings` asks once whether the backend serves `/v1/embeddings` (vLLM mounts
that route only for a model that embeds; /v1/models does not say).
Samples with several label sets (one per engine or model) are summed, except KV-cache
usage, which takes the fullest engine, and the KV capacity (`vllm:cache_config_info`'s
labels: num_gpu_blocks x block_size, the same in vLLM 0.26 and 0.32; `kv_cache_size_tokens`
where a server adds it), which takes the smallest engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorastack.parity import CHECK_PREFIX

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # deprecated; older servers emit only this
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG = "vllm:cache_config_info"


@dataclass(frozen=True)
class BackendMetrics:
    """What one scrape of a backend's /metrics tells: KV usage and capacity, queues, adapters."""

    kv_usage: float | None = None  # 0..1
    running: int = 0
    waiting: int = 0
    preemptions: float = 0.0  # counter since the backend started
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    kv_capacity_tokens: int | None = None  # KV cache vLLM allocated; None = not reported
    block_size: int = 16  # tokens per KV block


def kv_capacity(labels: dict[str, str]) -> tuple[int, int] | None:
    """(capacity tokens, block size) from `vllm:cache_config_info` labels, or None while
    vLLM has not sized its cache yet (num_gpu_blocks "None")."""
    block = labels.get("block_size", "")
    if not block.isdigit() or int(block) <= 0:
        return None
    if labels.get("kv_cache_size_tokens", "").isdigit():
        return int(labels["kv_cache_size_tokens"]), int(block)
    blocks = labels.get("num_gpu_blocks", "")
    return (int(blocks) * int(block), int(block)) if blocks.isdigit() else None


@dataclass(frozen=True)
class ModelInfo:
    """One model card of a backend's /v1/models."""

    id: str
    max_model_len: int | None
    parent: str | None  # the base model of a LoRA adapter
    root: str | None  # for a base model: where vLLM loaded it from


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in value.split(",")) if a)


def parse_metrics(text: str) -> BackendMetrics:
    """The `BackendMetrics` in a vLLM /metrics text: queues summed over engines, the highest KV
    usage, the newest LoRA info and the smallest KV capacity."""
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    lora: tuple[float, dict[str, str]] | None = None
    capacity: tuple[int, int] | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (KV_USAGE, KV_USAGE_OLD):
                kv[s.name] = max(kv.get(s.name, 0.0), s.value)
            elif s.name in (RUNNING, WAITING, PREEMPTIONS):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            elif s.name == LORA_INFO and (lora is None or s.value >= lora[0]):
                lora = (s.value, s.labels)  # value = time of the update; keep the newest
            elif s.name == CACHE_CONFIG:
                found = kv_capacity(s.labels)
                if found is not None and (capacity is None or found[0] < capacity[0]):
                    capacity = found
    labels = lora[1] if lora else {}
    max_lora = labels.get("max_lora", "0")
    return BackendMetrics(
        kv_usage=kv.get(KV_USAGE, kv.get(KV_USAGE_OLD)),
        running=int(sums.get(RUNNING, 0)),
        waiting=int(sums.get(WAITING, 0)),
        preemptions=sums.get(PREEMPTIONS, 0.0),
        running_adapters=_adapters(labels.get("running_lora_adapters", "")),
        waiting_adapters=_adapters(labels.get("waiting_lora_adapters", "")),
        max_lora=int(max_lora) if max_lora.isdigit() else 0,
        kv_capacity_tokens=capacity[0] if capacity else None,
        block_size=capacity[1] if capacity else 16,
    )


def parse_models(body: dict[str, Any]) -> dict[str, ModelInfo]:
    """The model cards of a /v1/models body by id (cards without a string id skipped, and
    adapters the inference supervisor is checking: loaded under lorastack.parity's
    CHECK_PREFIX until their parity verdict, never listed or routed to)."""
    out = {}
    for card in body.get("data", []):
        if (
            isinstance(card, dict)
            and isinstance(card.get("id"), str)
            and not card["id"].startswith(CHECK_PREFIX)
        ):
            mml = card.get("max_model_len")
            out[card["id"]] = ModelInfo(
                id=card["id"],
                max_model_len=mml if isinstance(mml, int) else None,
                parent=card.get("parent") if card.get("parent") != card["id"] else None,
                root=card.get("root"),
            )
    return out


async def probe_embeddings(client: httpx.AsyncClient, url: str) -> bool:
    """True when `POST /v1/embeddings` exists there (an empty body: vLLM answers 400/422
    from the route, 404 when the route is not mounted)."""
    r = await client.post(f"{url}/v1/embeddings", json={})
    return r.status_code not in (404, 405)


async def scrape_backend(
    client: httpx.AsyncClient, url: str
) -> tuple[dict[str, ModelInfo], BackendMetrics]:
    """GET /v1/models and /metrics; raises httpx errors when the backend is down."""
    models = await client.get(f"{url}/v1/models")
    models.raise_for_status()
    metrics = await client.get(f"{url}/metrics")
    metrics.raise_for_status()
    return parse_models(models.json()), parse_metrics(metrics.text)
