"""Read a vLLM backend: parse its Prometheus `/metrics` text and its `/v1/models` list.

`parse_metrics` and `parse_models` are pure; `scrape_backend` does the two GETs;
`probe_embeddings` asks once whether the backend serves `/v1/embeddings` (vLLM mounts
that route only for a model that embeds; /v1/models does not say).
Samples with several label sets (one per engine or model) are summed, except KV-cache
usage, which takes the fullest engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # deprecated; older servers emit only this
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True)
class BackendMetrics:
    kv_usage: float | None = None  # 0..1
    running: int = 0
    waiting: int = 0
    preemptions: float = 0.0  # counter since the backend started
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int | None
    parent: str | None  # the base model of a LoRA adapter
    root: str | None  # for a base model: where vLLM loaded it from


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a for a in (s.strip() for s in value.split(",")) if a)


def parse_metrics(text: str) -> BackendMetrics:
    sums: dict[str, float] = {}
    kv: dict[str, float] = {}
    lora: tuple[float, dict[str, str]] | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (KV_USAGE, KV_USAGE_OLD):
                kv[s.name] = max(kv.get(s.name, 0.0), s.value)
            elif s.name in (RUNNING, WAITING, PREEMPTIONS):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            elif s.name == LORA_INFO and (lora is None or s.value >= lora[0]):
                lora = (s.value, s.labels)  # value = time of the update; keep the newest
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
    )


def parse_models(body: dict[str, Any]) -> dict[str, ModelInfo]:
    out = {}
    for card in body.get("data", []):
        if isinstance(card, dict) and isinstance(card.get("id"), str):
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
