"""Cost arithmetic: table tests with hand-computed answers, and the CLI printouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluation.cost import (
    actual_training,
    cost_per_million_tokens,
    estimate_training,
    serving_costs,
    steps_for,
    time_warm_steps,
)
from lorastack.cli import main as cli_main
from lorastack.errors import ConfigError


@pytest.mark.parametrize(
    ("kw", "compute", "allowance", "storage"),
    [
        # 3600 steps x 1 s = 1 GPU-h at 2/h; allowance (0.25 + 0.1 x 1) h x 2
        ({"steps": 3600, "seconds_per_step": 1.0, "price_per_gpu_hour": 2.0}, 2.0, 0.7, 0.0),
        # 2 GPUs double compute and set-up
        ({"steps": 3600, "seconds_per_step": 1.0, "price_per_gpu_hour": 2.0, "gpus": 2}, 4.0, 1.4, 0.0),
        # storage: 10 GB x 0.02/GB-month x 3 months
        ({"steps": 75, "seconds_per_step": 0.48, "price_per_gpu_hour": 3.5, "storage_gb": 10,
          "price_per_gb_month": 0.02, "storage_months": 3, "setup_hours": 0, "idle_fraction": 0},
         75 * 0.48 / 3600 * 3.5, 0.0, 0.6),
        ({"steps": 1, "seconds_per_step": 0.0, "price_per_gpu_hour": 0.0}, 0.0, 0.0, 0.0),
    ],
)  # fmt: skip
def test_estimate_lines(
    kw: dict[str, float], compute: float, allowance: float, storage: float
) -> None:
    r = estimate_training(**kw)  # type: ignore[arg-type]
    amounts = {x.item: x.amount for x in r.lines}
    assert amounts["compute"] == pytest.approx(compute)
    assert amounts["set-up and idle allowance"] == pytest.approx(allowance)
    assert amounts["storage"] == pytest.approx(storage)
    assert r.total == pytest.approx(compute + allowance + storage)
    assert any("seconds per step" in a for a in r.assumptions)


@pytest.mark.parametrize(
    ("examples", "batch", "epochs", "steps"),
    [(200, 8, 3, 75), (201, 8, 3, 78), (8, 8, 1, 1), (100, 8, 0.5, 7)],
)
def test_steps_for(examples: int, batch: int, epochs: float, steps: int) -> None:
    assert steps_for(examples, batch, epochs) == steps


def test_time_warm_steps_skips_warmup() -> None:
    recs = [{"step": 1, "step_time_s": 9.0}, {"step": 2, "step_time_s": 5.0},
            {"step": 3, "step_time_s": 1.0}, {"step": 4, "step_time_s": 2.0},
            {"step": 5, "step_time_s": 3.0}, {"step": 6, "loss": 1.0}]  # fmt: skip
    t = time_warm_steps(recs, warmup_steps=2)
    assert (t.seconds_per_step, t.median_s, t.warm_steps, t.skipped_steps) == (2.0, 2.0, 3, 2)
    with pytest.raises(ConfigError, match="no timed steps after the first 5"):
        time_warm_steps(recs, warmup_steps=5)


@pytest.mark.parametrize(
    ("complete", "price", "amount"),
    [
        ({"billed_hours": 0.5, "price_per_gpu_hour": 4.0, "cost": 2.0}, None, 2.0),
        ({"billed_hours": 0.5, "price_per_gpu_hour": 4.0}, 3.5, 1.75),
        ({"wall_s": 7200, "gpus": 2}, 1.0, 4.0),
        ({"wall_s": 1800}, 3.0, 1.5),
    ],
)
def test_actual(complete: dict[str, float], price: float | None, amount: float) -> None:
    assert actual_training(complete, price_per_gpu_hour=price).total == pytest.approx(amount)


def test_actual_needs_time() -> None:
    with pytest.raises(ConfigError, match="neither billed_hours nor wall_s"):
        actual_training({"steps": 3})


@pytest.mark.parametrize(
    ("price", "tps", "per_million"),
    [(3.6, 1000.0, 1.0), (3.5, 2500.0, 3.5 / 9.0), (0.0, 10.0, 0.0), (1.0, 1.0, 1e6 / 3600)],
)
def test_cost_per_million(price: float, tps: float, per_million: float) -> None:
    assert cost_per_million_tokens(price, tps) == pytest.approx(per_million)


def test_cost_per_million_needs_throughput() -> None:
    with pytest.raises(ConfigError, match="output tokens/s"):
        cost_per_million_tokens(1.0, 0.0)
    with pytest.raises(ConfigError, match="price per hour"):
        cost_per_million_tokens(-1.0, 5.0)


def _level(kind: str, value: float, tps: float) -> dict[str, object]:
    return {"level": {"kind": kind, "value": value}, "output_tokens_per_s": tps, "errors": 0,
            "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 20.0}}  # fmt: skip


def test_serving_rows_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = {"levels": [_level("concurrency", 1, 100.0), _level("rate", 2, 360.0)]}
    rows = serving_costs(report, price_per_hour=3.6)
    assert [(r.level, r.cost_per_million) for r in rows] == [
        ("c=1", 10.0),
        ("2 req/s", pytest.approx(2.7777, rel=1e-3)),
    ]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert cli_main(["cost", "serving", str(tmp_path), "--price-per-hour", "3.6"]) == 0
    assert "10.0000 USD" in capsys.readouterr().out


def test_cli_estimate_from_metrics_and_actual(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = tmp_path / "run" / "metrics"
    m.mkdir(parents=True)
    for step, t in [(1, 30.0), (2, 6.0), (3, 6.0), (4, 6.0)]:
        (m / f"metrics-step-{step}.json").write_text(json.dumps({"step": step, "step_time_s": t}))
    code = cli_main(["cost", "estimate", "--examples", "200", "--batch-size", "8", "--epochs", "3",
                     "--metrics", str(tmp_path / "run"), "--warmup-steps", "1",
                     "--price-per-gpu-hour", "3.6", "--setup-hours", "0", "--idle-fraction", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "75 steps x 6 s/step" in out and "0.4500" in out  # 75 x 6 s = 0.125 h x 3.6
    assert "mean of 3 warm steps" in out
    (tmp_path / "run" / "training-complete.json").write_text(
        json.dumps(
            {
                "wall_s": 450.0,
                "steps": 75,
                "billed_hours": 0.125,
                "price_per_gpu_hour": 3.6,
                "cost": 0.45,
            }
        )
    )
    assert cli_main(["cost", "actual", str(tmp_path / "run")]) == 0
    assert "0.4500" in capsys.readouterr().out
    assert cli_main(["cost", "estimate", "--steps", "10", "--price-per-gpu-hour", "1"]) == 2
