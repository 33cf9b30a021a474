"""The Grafana dashboard queries only metrics that the gateway, the inference
supervisor, the trainer or vLLM really export. (The end-to-end test checks them again against the
live stack's /metrics.)"""

from __future__ import annotations

import re
from pathlib import Path

from dashboard_queries import DASHBOARD, dashboard_exprs, missing_from, trainer_metric_names
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
PANELS_PEOPLE_EXPECT = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "lorastack_gateway_time_to_first_token_seconds_bucket",
    "lorastack_gateway_time_per_output_token_seconds_bucket",
    "lorastack_gateway_output_tokens_sum",
    "lorastack_gateway_request_duration_seconds_count",
    "lorastack_gateway_rejections_total",
    "vllm:lora_requests_info",
    "lorastack_trainer_loss",
    "lorastack_trainer_val_loss",
    "lorastack_trainer_tokens_per_second",
    "lorastack_trainer_gpu_memory_reserved_bytes",
    "lorastack_trainer_cost",
    "lorastack_gateway_key_requests_total",
    "lorastack_gateway_key_completion_tokens_total",
)


def exported_by_vllm() -> set[str]:
    """Names the installed vLLM registers (its exporter's source is the truth)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # located, not imported (importing takes ~20 s)
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
    names: set[str] = set()
    for f in root.glob("*.py"):
        for name in re.findall(r'"(vllm:[a-z_]+)"', f.read_text()):
            names |= {name, name + "_total", name + "_bucket", name + "_sum", name + "_count"}
    return names


def exported_by_gateway() -> set[str]:
    from gateway.metrics import GatewayMetrics

    text = generate_latest(GatewayMetrics().registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples} | {
        fam.name for fam in text_string_to_metric_families(text)
    }


def exported_by_supervisor() -> set[str]:
    src = (REPO / "services/inference/src/inference/metrics.py").read_text()
    names = set(re.findall(r'"(lorastack_inference_[a-z_]+)"', src))
    return names | {n + "_total" for n in names}


def test_dashboard_has_the_panels_people_expect() -> None:
    text = DASHBOARD.read_text()
    for name in PANELS_PEOPLE_EXPECT:
        assert name in text, name


def test_every_query_names_an_exported_metric() -> None:
    exposed = (
        exported_by_vllm()
        | exported_by_gateway()
        | exported_by_supervisor()
        | trainer_metric_names()
    )
    assert dashboard_exprs()
    assert missing_from(exposed) == {}
