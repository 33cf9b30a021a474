"""Cost arithmetic: before a training run, after it, and per million served tokens.

Pure functions over plain numbers; every result carries its line items, each with the
formula that made it, and the assumptions behind it, so the printout can be checked by
hand. Money is in `currency` units; time in seconds or hours as named.

    before a run   compute = steps x s/step / 3600 x GPUs x price/GPU-h
                   allowance = (set-up hours x GPUs + idle fraction x compute hours) x price
                   storage = GB x price/GB-month x months
    after a run    billed GPU-hours (training-complete.json) x price/GPU-h
    serving        price/h / (output tokens/s x 3600) x 1e6   per million output tokens
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

from lorastack.errors import ConfigError

SECONDS_PER_HOUR = 3600.0


class Line(BaseModel):
    """One line of a cost report: what it costs, the formula with its numbers, the amount."""

    item: str
    formula: str  # with the numbers filled in
    amount: float  # currency units


class CostReport(BaseModel):
    """A cost report: its lines (summed in `total`) and the assumptions behind them."""

    title: str
    currency: str
    lines: list[Line]
    assumptions: list[str]

    @property
    def total(self) -> float:
        return sum(x.amount for x in self.lines)


def _positive(name: str, value: float, allow_zero: bool = True) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(
            f"{name} = {value} is not {'>= 0' if allow_zero else '> 0'}", f"give a valid {name}"
        )


def steps_for(examples: int, batch_size: int, epochs: float) -> int:
    """Optimizer steps of a run: ceil(examples / batch size) per epoch, times epochs."""
    if examples < 1 or batch_size < 1 or epochs <= 0:
        raise ConfigError(
            "examples, batch size and epochs must be positive", "check --examples/--batch-size"
        )
    return math.ceil(math.ceil(examples / batch_size) * epochs)


class StepTiming(BaseModel):
    """Seconds per training step over the warm steps, and how many steps were used or skipped."""

    seconds_per_step: float  # mean over the warm steps
    median_s: float
    warm_steps: int  # steps used
    skipped_steps: int  # warm-up steps left out


def time_warm_steps(records: Iterable[Mapping[str, Any]], warmup_steps: int = 2) -> StepTiming:
    """Seconds per step from the trainer's metrics-step-N.json records (`step`, `step_time_s`),
    leaving out the first `warmup_steps` (allocation, compilation, caches)."""
    rows = sorted(
        (int(r["step"]), float(r["step_time_s"]))
        for r in records
        if "step" in r and r.get("step_time_s") is not None
    )
    warm = [t for step, t in rows if step > warmup_steps]
    if not warm:
        raise ConfigError(
            f"no timed steps after the first {warmup_steps} (found {len(rows)} timed steps)",
            "run a longer smoke run, lower --warmup-steps, or give --seconds-per-step",
        )
    return StepTiming(
        seconds_per_step=sum(warm) / len(warm),
        median_s=statistics.median(warm),
        warm_steps=len(warm),
        skipped_steps=len(rows) - len(warm),
    )


def estimate_training(
    *,
    steps: int,
    seconds_per_step: float,
    price_per_gpu_hour: float,
    gpus: int = 1,
    storage_gb: float = 0.0,
    price_per_gb_month: float = 0.0,
    storage_months: float = 1.0,
    setup_hours: float = 0.25,  # per GPU: image pull, model download, preflight
    idle_fraction: float = 0.10,  # of compute time: evals, checkpoints, waiting
    currency: str = "USD",
    timing_source: str = "given",
) -> CostReport:
    """The cost of a training run before it runs: compute, a set-up and idle allowance, and
    storage.

    Raises ConfigError for fewer than 1 step or GPU, or a number that is negative or not
    finite."""
    if steps < 1 or gpus < 1:
        raise ConfigError("steps and GPUs must be at least 1", "check --steps and --gpus")
    for name, v in (("seconds per step", seconds_per_step), ("price per GPU-hour", price_per_gpu_hour),
                    ("storage GB", storage_gb), ("price per GB-month", price_per_gb_month),
                    ("storage months", storage_months), ("set-up hours", setup_hours),
                    ("idle fraction", idle_fraction)):  # fmt: skip
        _positive(name, v)
    compute_h = steps * seconds_per_step / SECONDS_PER_HOUR * gpus  # GPU-hours
    allowance_h = setup_hours * gpus + idle_fraction * compute_h  # GPU-hours
    lines = [
        Line(
            item="compute",
            formula=f"{steps} steps x {seconds_per_step:.4g} s/step / 3600 x {gpus} GPU "
            f"= {compute_h:.4g} GPU-h x {price_per_gpu_hour:g}/GPU-h",
            amount=compute_h * price_per_gpu_hour,
        ),
        Line(
            item="set-up and idle allowance",
            formula=f"({setup_hours:g} h x {gpus} GPU + {idle_fraction:g} x {compute_h:.4g} GPU-h) "
            f"= {allowance_h:.4g} GPU-h x {price_per_gpu_hour:g}/GPU-h",
            amount=allowance_h * price_per_gpu_hour,
        ),
        Line(
            item="storage",
            formula=f"{storage_gb:g} GB x {price_per_gb_month:g}/GB-month x {storage_months:g} months",
            amount=storage_gb * price_per_gb_month * storage_months,
        ),
    ]
    assumptions = [
        f"seconds per step: {seconds_per_step:.4g} ({timing_source})",
        f"steps: {steps}; GPUs: {gpus}; price {price_per_gpu_hour:g} {currency} per GPU-hour",
        f"set-up allowance {setup_hours:g} h per GPU; idle/eval/checkpoint allowance "
        f"{idle_fraction:.0%} of compute time",
        f"storage {storage_gb:g} GB for {storage_months:g} months at {price_per_gb_month:g} "
        f"{currency}/GB-month",
        "billing by the second; no spot interruptions, retries or failed runs included",
    ]
    return CostReport(
        title="training estimate", currency=currency, lines=lines, assumptions=assumptions
    )


def actual_training(
    complete: Mapping[str, Any], *, price_per_gpu_hour: float | None = None, currency: str = "USD"
) -> CostReport:
    """The cost of a finished run from its training-complete.json (billed GPU-hours x price)."""
    if "billed_hours" in complete:
        billed_h = float(complete["billed_hours"])
        source = "billed_hours from training-complete.json (wall time x GPUs)"
    elif "wall_s" in complete:
        billed_h = float(complete["wall_s"]) / SECONDS_PER_HOUR * int(complete.get("gpus", 1))
        source = "wall_s from training-complete.json / 3600 x GPUs"
    else:
        raise ConfigError(
            "training-complete.json has neither billed_hours nor wall_s",
            "give the training-complete.json of a finished run",
        )
    price = (
        price_per_gpu_hour
        if price_per_gpu_hour is not None
        else float(complete.get("price_per_gpu_hour") or 0)
    )
    _positive("price per GPU-hour", price)
    line = Line(
        item="compute (actual)",
        formula=f"{billed_h:.4g} GPU-h x {price:g}/GPU-h",
        amount=billed_h * price,
    )
    assumptions = [
        f"time: {source}",
        f"wall {float(complete.get('wall_s', billed_h * SECONDS_PER_HOUR)):.1f} s for "
        f"{complete.get('steps', '?')} steps, {complete.get('tokens', '?')} tokens",
        f"price: {price:g} {currency} per GPU-hour"
        + (" (given)" if price_per_gpu_hour is not None else " (recorded by the run)"),
        "excludes storage, set-up and idle time outside the training process",
    ]
    if "cost" in complete and price_per_gpu_hour is None:
        assumptions.append(f"the run recorded cost {complete['cost']}")
    return CostReport(
        title="training actual", currency=currency, lines=[line], assumptions=assumptions
    )


def cost_per_million_tokens(price_per_hour: float, output_tokens_per_s: float) -> float:
    """Currency units per 1e6 output tokens at a sustained throughput."""
    _positive("price per hour", price_per_hour)
    _positive("output tokens/s", output_tokens_per_s, allow_zero=False)
    return price_per_hour / (output_tokens_per_s * SECONDS_PER_HOUR) * 1e6


class ServingRow(BaseModel):
    """One load-test level's throughput and latency, and its cost per million output tokens."""

    level: str
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    errors: int
    cost_per_million: float  # currency units per 1e6 output tokens


def serving_costs(loadtest: Mapping[str, Any], price_per_hour: float) -> list[ServingRow]:
    """One row per level of a `lorastack loadtest` report.json."""
    levels = loadtest.get("levels")
    if not isinstance(levels, list) or not levels:
        raise ConfigError(
            "the load test JSON holds no levels", "give report.json of 'lorastack loadtest'"
        )
    rows = []
    for lv in levels:
        tps = float(lv["output_tokens_per_s"])
        kind, value = lv["level"]["kind"], lv["level"]["value"]
        label = f"c={value:g}" if kind == "concurrency" else f"{value:g} req/s"
        rows.append(
            ServingRow(
                level=label,
                output_tokens_per_s=tps,
                ttft_p50_ms=lv["ttft_ms"]["p50"],
                tpot_p50_ms=lv["tpot_ms"]["p50"],
                errors=int(lv["errors"]),
                cost_per_million=cost_per_million_tokens(price_per_hour, tps)
                if tps > 0
                else math.inf,
            )
        )
    return rows
