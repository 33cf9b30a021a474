"""The supervisor's /status body, built from a snapshot of its state: what it serves,
its vLLM process, restarts and the last exit's root cause, the KV-cache comparison and
the log tail.

Owns: that body's shape. Does not own: the state (supervisor.py), the comparison
(kv_report.py), the route (main.py).
"""

from __future__ import annotations

import time
from typing import Any

from inference.artifacts import ServedModel
from inference.engine import VllmServer
from inference.engine_log import RootCause
from inference.restarts import ExitRecord


def status_body(
    *,
    state: str,
    ready: bool,
    platform: str,
    model: ServedModel,
    served_name: str,
    adapters: list[dict[str, object]],
    chat_format: dict[str, Any],
    server: VllmServer | None,
    started_at: float,  # unix time of the current start
    restarts: int,
    last_error: str,
    root_cause: RootCause | None,
    last_exit: ExitRecord | None,
    kv_cache: dict[str, Any],
    log_tail_lines: int,
    dtype: dict[str, str],
    parity: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The /status body from a snapshot of the supervisor's state."""
    m = model.manifest
    return {
        "state": state,
        "ready": ready,
        "platform": platform,
        "model": {
            "ref": m.ref,
            "kind": m.kind,
            "digest": m.digest,
            "served_name": served_name,
            "path": str(model.path),
        },
        "adapters": adapters,
        "dtype": dtype,
        "parity": parity,
        "chat_format": chat_format,
        "vllm": {
            "base_url": server.base_url if server else None,
            "pid": server.pid if server else None,
            "running": bool(server and server.running),
            "log": str(server.log_path) if server else None,
            "uptime_s": round(time.time() - started_at, 1) if ready else 0.0,
        },
        "restarts": restarts,
        "last_error": last_error,
        "root_cause": {
            "error": str(root_cause),
            "process": root_cause.process,
            "hint": root_cause.hint,
        }
        if root_cause
        else None,
        "last_exit": last_exit.__dict__ if last_exit else None,
        "kv_cache": kv_cache,
        "log_tail": server.log_tail(log_tail_lines).splitlines() if server else [],
    }
