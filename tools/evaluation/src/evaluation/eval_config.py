"""What an evaluation compares and how: `EvalConfig`, from YAML and/or flags.

    base_url: http://127.0.0.1:8080      # any OpenAI-compatible endpoint, normally the gateway
    test: demo/test                      # a store ref NAME[:VERSION] or a local test.jsonl
    base_model: smollm2                  # served name of the base model (the baseline)
    lora_model: demo-adapter             # served name of the adapter or the merged model
    system_prompt: "Answer with the ISO date only."   # baseline only
    few_shot:                            # baseline only, put before the test prompt
      - {user: "March 3, 2021", assistant: "2021-03-03"}
    scorers: [exact, normalised, contains, {name: regex, pattern: '^\\d{4}-\\d{2}-\\d{2}$'}]
    primary_metric: exact                # `lorastack promote` decides on it; default: 1st scorer
    max_tokens: 64                       # tokens per answer; greedy (temperature 0)
    concurrency: 4                       # requests in flight

Validation happens here, before any request is sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from evaluation.scorers import build_scorer
from lorastack.errors import ConfigError, field_errors
from lorastack.settings import read_yaml_mapping

DEFAULT_SCORERS: list[str | dict[str, Any]] = ["exact", "normalised", "contains"]


class FewShot(BaseModel):
    """One few-shot example for the baseline: a user turn and the assistant's answer."""

    user: str = Field(min_length=1)
    assistant: str = Field(min_length=1)


class EvalConfig(BaseModel):
    """What an evaluation runs: the endpoint, the test data, the two models, the scorers, the
    decoding and the bootstrap settings."""

    model_config = {"extra": "forbid"}

    base_url: str
    test: str = Field(min_length=1, description="store ref NAME[:VERSION] or a test.jsonl path")
    base_model: str = Field(min_length=1)
    lora_model: str = Field(min_length=1)
    api_key: SecretStr | None = None
    system_prompt: str | None = None  # baseline only; replaces a system message of the item
    few_shot: list[FewShot] = []  # baseline only
    scorers: list[str | dict[str, Any]] = Field(default_factory=lambda: list(DEFAULT_SCORERS))
    max_tokens: int = Field(128, ge=1, le=8192)  # tokens per answer
    concurrency: int = Field(4, ge=1, le=256)  # requests in flight
    timeout_s: float = Field(300.0, gt=0)  # seconds per request
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    resamples: int = Field(2000, ge=100, le=1_000_000)
    seed: int = 0  # bootstrap seed; also sent to the server
    limit: int | None = Field(None, ge=1)  # evaluate the first N items only
    adapter: str | None = None  # store ref or folder: training/validation numbers for the report
    primary_metric: str | None = None  # a scorer's name; what promotion decides on (default: first)

    @field_validator("scorers")
    @classmethod
    def _scorers_build(cls, v: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        if not v:
            raise ValueError("give at least one scorer")
        names = []
        for spec in v:
            names.append(build_scorer(spec).name)  # raises ConfigError on a bad entry
        if len(set(names)) != len(names):
            raise ValueError(f"scorer names repeat: {names}; give each a distinct 'label'")
        return v

    @model_validator(mode="after")
    def _primary(self) -> EvalConfig:
        names = [build_scorer(s).name for s in self.scorers]
        if self.primary_metric is None:
            self.primary_metric = names[0]
        elif self.primary_metric not in names:
            raise ValueError(
                f"primary_metric {self.primary_metric!r} is not one of the scorers {names}"
            )
        return self


def load_eval_config(path: Path | None, overrides: dict[str, Any]) -> EvalConfig:
    """YAML file (optional) with flag values (not None) on top; errors name the field."""
    data: dict[str, Any] = {}
    if path is not None:
        data.update(read_yaml_mapping(path, "eval config", "e.g. 'base_url: http://...'"))
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return EvalConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {where}: {what}" for where, what in field_errors(e, "config")]
        raise ConfigError(
            "invalid eval config:\n" + "\n".join(lines),
            "fix these fields in the YAML file or the flags (see 'lorastack eval --help')",
        ) from e
