"""The KV-cache capacity the supervisor estimated next to the one vLLM reported (its log
and its cache_config_info metric), as /status and /metrics show it and the log line
after each start says it.

Owns: that comparison, pure over plain data. Does not own: the estimate and parsing
vLLM's figures (kv_cache.py), asking vLLM for them (supervisor.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from inference.kv_cache import (
    KvEstimate,
    VllmKvReport,
    parse_cache_config_info,
    parse_kv_log,
    relative_difference,
    tokens_from_cache_config,
)

log = logging.getLogger("inference.supervisor")

KV_PROMISE_PCT = 3.0  # the estimate is within this of vLLM's figure (README), percent
KV_LOG_FORMAT = "KV cache: estimated %s tokens, vLLM logged %s, vLLM metrics %s (difference %s%%)%s"


def kv_comparison(
    est: KvEstimate, report: VllmKvReport | None, info: dict[str, str] | None
) -> dict[str, Any]:
    """The estimate, vLLM's logged and metric figures, and their difference (percent of
    vLLM's, the log's figure first)."""
    metrics_tokens = tokens_from_cache_config(info) if info else None
    reported = report.capacity_tokens if report else metrics_tokens
    return {
        "estimate": est.as_dict(),
        "vllm_log": report.__dict__ if report else None,
        "vllm_metrics": {
            "capacity_tokens": metrics_tokens,
            "num_gpu_blocks": info.get("num_gpu_blocks"),
            "block_size": info.get("block_size"),
            "kv_cache_memory_bytes": info.get("kv_cache_memory_bytes"),
            "cache_config_info": info,
        }
        if info
        else None,
        "difference_pct": round(100 * relative_difference(est.capacity_tokens, reported), 3)
        if reported
        else None,
    }


def kv_log_line(kv: dict[str, Any], engine_args: list[str]) -> tuple[int, tuple[Any, ...]]:
    """The log level and `KV_LOG_FORMAT`'s arguments for a comparison: a warning when the
    estimate missed vLLM's figure by more than it promises."""
    diff = kv["difference_pct"]
    off = diff is not None and abs(diff) > KV_PROMISE_PCT
    why = (
        f": more than the +-{KV_PROMISE_PCT:g}% the estimate promises; vLLM's figure"
        " holds (admission and the gateway use it)"
        + (
            ", set by --num-gpu-blocks-override"
            if "--num-gpu-blocks-override" in " ".join(engine_args)
            else ""
        )
    )
    return logging.WARNING if off else logging.INFO, (
        kv["estimate"]["capacity_tokens"],
        kv["vllm_log"] and kv["vllm_log"]["capacity_tokens"],
        kv["vllm_metrics"] and kv["vllm_metrics"]["capacity_tokens"],
        diff,
        why if off else "",
    )


class KvFigures:
    """The supervisor's KV figures: its estimate and vLLM's latest report (its log line and
    cache_config_info), kept across restarts when a start reports none."""

    def __init__(self, estimate: KvEstimate) -> None:
        self.estimate = estimate
        self._lock = threading.Lock()
        self.report: VllmKvReport | None = None
        self.cache_config: dict[str, str] | None = None

    def read(self, vllm_log: str, metrics_text: str) -> None:
        """Take vLLM's figures from its log and /metrics text, keeping the old ones if absent."""
        report, info = parse_kv_log(vllm_log), parse_cache_config_info(metrics_text)
        with self._lock:
            self.report = report or self.report
            self.cache_config = info or self.cache_config

    def comparison(self) -> dict[str, Any]:
        """The estimate beside what vLLM reported."""
        with self._lock:
            report, info = self.report, self.cache_config
        return kv_comparison(self.estimate, report, info)

    def log(self, engine_args: list[str]) -> None:
        """The comparison's log line after a start, and the estimate's warnings."""
        level, args = kv_log_line(self.comparison(), engine_args)
        log.log(level, KV_LOG_FORMAT, *args)
        for w in self.estimate.warnings:
            log.warning("KV cache: %s", w)
