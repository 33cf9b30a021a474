"""The run record's files, found by step and read as typed records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorastack.errors import ConfigError
from lorastack.run_record import read_steps, step_file_name, step_files


def test_steps_are_found_in_step_order_and_keep_extra_fields(tmp_path: Path) -> None:
    metrics = tmp_path / "run" / "metrics"
    metrics.mkdir(parents=True)
    for step in (10, 2, 1):
        record = {"step": step, "loss": 1.0 / step, "step_time_s": 0.5, "peak_rss": 1024}
        (metrics / step_file_name(step)).write_text(json.dumps(record))
    (metrics / step_file_name(2, "eval")).write_text(json.dumps({"val_loss": 0.7}))
    (metrics / "notes-metrics-step-3.json").write_text("{}")  # not the trainer's
    assert [p.name for p in step_files(tmp_path)] == [
        "metrics-step-1.json",
        "metrics-step-2.json",
        "metrics-step-10.json",
    ]
    assert [p.name for p in step_files(tmp_path, "eval")] == ["eval-step-2.json"]
    steps = read_steps(tmp_path)
    assert [r.step for r in steps] == [1, 2, 10]
    assert steps[-1].loss == pytest.approx(0.1) and steps[-1].model_dump()["peak_rss"] == 1024


def test_a_damaged_record_is_named(tmp_path: Path) -> None:
    (tmp_path / step_file_name(1)).write_text('{"loss": 1.0}')  # no step
    with pytest.raises(ConfigError, match=r"metrics-step-1\.json is not a metrics record"):
        read_steps(tmp_path)
