"""What a load test sends and measures: `LoadtestConfig`, validated before any request."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator


class LoadtestConfig(BaseModel):
    """What a load test runs: the endpoint and model, the levels (concurrency or arrival rate),
    the prompts, the SLOs and the server metrics to sample."""

    model_config = {"extra": "forbid"}

    base_url: str  # any OpenAI-compatible endpoint (vLLM or the gateway)
    model: str = Field(min_length=1)  # served model name
    api_key: SecretStr | None = None
    endpoint: Literal["chat", "completions"] = "chat"
    concurrency: list[int] = []  # levels: at most this many requests in flight
    rates: list[float] = []  # levels: Poisson arrivals, requests per second
    max_concurrency: int | None = Field(None, ge=1)  # cap for rate levels (None: no cap)
    requests: int = Field(32, ge=1, le=100_000)  # requests per level
    max_duration_s: float = Field(600.0, gt=0)  # seconds: no new request after this per level
    warmup: int = Field(1, ge=0, le=100)  # requests before the first level, not counted
    input_len: int = Field(128, ge=1, le=1_000_000)  # tokens in each synthetic prompt
    output_len: int = Field(64, ge=1, le=1_000_000)  # tokens asked for (max_tokens)
    ignore_eos: bool = True  # vLLM extension: generate exactly output_len tokens
    prompts_file: Path | None = None  # JSONL: {"prompt": ...} or {"messages": [...]} per line
    tokenizer: Path | None = None  # model folder: exact token lengths and counts
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    metrics_url: str | None = None  # the server's /metrics (vLLM's, not the gateway's)
    metrics_interval_s: float = Field(0.5, gt=0)
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(600.0, gt=0)  # seconds per request
    seed: int = 0
    processes: int = Field(1, ge=1, le=64)  # client processes sharing each level

    @model_validator(mode="after")
    def _levels(self) -> LoadtestConfig:
        if not self.concurrency and not self.rates:
            raise ValueError("give --concurrency levels and/or --rate levels")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency levels must be >= 1")
        if any(r <= 0 for r in self.rates):
            raise ValueError("request rates must be > 0")
        return self
