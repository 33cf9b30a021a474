"""Metric names used by the Grafana dashboard's queries, for the dashboard tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards/lorastack.json"
_NAME = re.compile(r"\b((?:vllm:|lorastack_)[a-zA-Z0-9_:]+)")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def family(sample_name: str) -> str:
    """The family a sample name belongs to: strip histogram/counter suffixes."""
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix) and sample_name != "vllm:lora_requests_info":
            return sample_name[: -len(suffix)]
    return sample_name


def missing_from(exposed_samples: set[str]) -> dict[str, set[str]]:
    """Queries whose metric names appear in none of the exposed sample names."""
    exposed = exposed_samples | {family(s) for s in exposed_samples}
    out: dict[str, set[str]] = {}
    for expr in dashboard_exprs():
        gone = {n for n in metric_names(expr) if n not in exposed and family(n) not in exposed}
        if gone:
            out[expr] = gone
    return out


def trainer_metric_names() -> set[str]:
    """The trainer's gauges: a training run serves them (trainer.loop.live), not the serving
    stack."""
    from trainer.loop.live import GAUGES

    return {f"lorastack_trainer_{name}" for name in GAUGES}
