"""The run record: what a training run leaves in its folder (and its adapter artifact's
`metrics/`), as typed models in one place.

    metrics/metrics-step-N.json   StepRecord, one per log interval
    metrics/eval-step-N.json      one per validation pass (`val_loss`, ...)
    training-complete.json        the finished run's summary

The trainer writes them; the tools (`lorastack eval`, `lorastack cost`) read them through
`step_files` and `read_steps`, never by pattern-matching names of their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from lorastack.errors import ConfigError

COMPLETE_FILE = "training-complete.json"
_NUMBERED = {
    "metrics": re.compile(r"^metrics-step-(\d+)\.json$"),
    "eval": re.compile(r"^eval-step-(\d+)\.json$"),
}


def step_file_name(step: int, kind: Literal["metrics", "eval"] = "metrics") -> str:
    """The file name of one step's metrics or evaluation record."""
    return f"{kind}-step-{step}.json"


class StepRecord(BaseModel):
    """One metrics-step-N.json. Memory readings (bytes: `peak_allocated`, `rss`, ...) and
    whatever a later trainer adds are kept as extra fields."""

    model_config = ConfigDict(extra="allow")

    step: int  # optimizer steps done
    loss: float | None = None  # training loss of the interval
    lr: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None  # supervised tokens in the step
    tokens_total: int | None = None  # since the run started
    tokens_per_s: float | None = None
    step_time_s: float | None = None  # seconds, wall time of the step


def step_files(folder: Path, kind: Literal["metrics", "eval"] = "metrics") -> list[Path]:
    """The numbered files of one kind anywhere below `folder`, by step."""
    pattern = _NUMBERED[kind]
    found = [(int(m.group(1)), p) for p in folder.rglob("*.json") if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def read_steps(folder: Path) -> list[StepRecord]:
    """Every metrics-step-N.json below `folder`, by step; a damaged one is named."""
    records = []
    for path in step_files(folder):
        try:
            records.append(StepRecord.model_validate(json.loads(path.read_text())))
        except (ValueError, ValidationError) as e:
            raise ConfigError(
                f"{path} is not a metrics record of the trainer: {e}",
                "point at the run's folder (or its metrics/) as the trainer wrote it",
            ) from None
    return records
