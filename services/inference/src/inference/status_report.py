"""The supervisor's /status body as typed models: what it serves, its vLLM process,
restarts and the last exit's root cause, the KV-cache comparison, the parity verdicts and
the log tail. Each field says what it holds, so this module is also the page's reference.

Owns: that body's shape and how each part is read off the objects it describes. Does not
own: the state (supervisor.py), the comparison (kv_report.py), the verdicts (parity.py),
the route (main.py, which adds the label follower's and the declared adapters' parts).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from inference.artifacts import ServedModel
from inference.engine import VllmServer
from inference.engine_log import RootCause
from inference.parity import ParityRecord


class ModelStatus(BaseModel):
    """The model vLLM serves."""

    ref: str = Field(description="its store ref, NAME:VERSION")
    kind: str = Field(description="base-model or merged-model")
    digest: str
    served_name: str = Field(description="the name clients ask for")
    path: str = Field(description="the folder vLLM loads")

    @classmethod
    def of(cls, model: ServedModel, served_name: str) -> ModelStatus:
        m = model.manifest
        return cls(
            ref=m.ref, kind=m.kind, digest=m.digest, served_name=served_name, path=str(model.path)
        )


class VllmStatus(BaseModel):
    """The vLLM process of the current start (all None or 0 before the first)."""

    base_url: str | None
    pid: int | None
    running: bool
    log: str | None = Field(description="its log file")
    uptime_s: float = Field(description="seconds since the current start; 0.0 unless ready")

    @classmethod
    def of(cls, server: VllmServer | None, *, started_at: float, ready: bool) -> VllmStatus:
        """`started_at`: unix time of the current start."""
        return cls(
            base_url=server.base_url if server else None,
            pid=server.pid if server else None,
            running=bool(server and server.running),
            log=str(server.log_path) if server else None,
            uptime_s=round(time.time() - started_at, 1) if ready else 0.0,
        )


class RootCauseStatus(BaseModel):
    """The first exception of vLLM's failing process (inference.engine_log)."""

    error: str = Field(description="`Name: message`")
    process: str | None = Field(description="vLLM's process label, e.g. EngineCore_DP0")
    hint: str = Field(description="what to change")

    @classmethod
    def of(cls, cause: RootCause | None) -> RootCauseStatus | None:
        if cause is None:
            return None
        return cls(error=str(cause), process=cause.process, hint=cause.hint)


class SupervisorStatus(BaseModel):
    """The supervisor's part of /status, from one snapshot of its state."""

    state: str = Field(
        description="created, starting, warming, ready, restarting, refused, failed, "
        "draining, stopping or stopped (inference.supervisor)"
    )
    ready: bool = Field(description="answers /v1/models and a warm-up, and passed parity")
    platform: str = Field(description="cpu or cuda")
    model: ModelStatus
    adapters: list[dict[str, Any]] = Field(description="inference.artifacts.ServedAdapter.describe")
    dtype: dict[str, str] = Field(description="`served`: what vLLM computes in; `why`")
    parity: dict[str, ParityRecord] = Field(
        description="by served name: its parity verdict, why its check could not run, or "
        "that it carries no reference (inference.parity)"
    )
    chat_format: dict[str, Any] = Field(description="template and tool parser, and their source")
    vllm: VllmStatus
    restarts: int
    last_error: str
    root_cause: RootCauseStatus | None = Field(description="of the last exit, when read")
    last_exit: dict[str, Any] | None = Field(description="inference.restarts.ExitRecord")
    kv_cache: dict[str, Any] = Field(description="our estimate beside vLLM's figures")
    log_tail: list[str] = Field(description="the last lines of vLLM's log")


class StatusBody(SupervisorStatus):
    """All of /status: the supervisor's part, the label follower's and the declared
    adapters' (inference.label_follow, inference.declared_adapters)."""

    labels: dict[str, Any]
    declared: dict[str, Any]
