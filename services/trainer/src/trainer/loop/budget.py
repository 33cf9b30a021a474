"""The cost cap: what a run may spend (`max_cost`, in currency units) and how long it may
take (`max_hours`, wall clock, every session of a resumed run together).

Owns the preflight estimate (measured seconds per step x steps left, plus the set-up
allowance and the evaluation/checkpoint allowance; refused with the overshoot), the
meter that tells the recipe to stop before the next step would pass a cap, and the
words and resume command of that stop. Pure arithmetic over plain numbers, except
`measured_step_time` (reads a run's step records) and the meter's clock, which is
injectable (tests run a fake one). Cost = hours x GPUs x price_per_gpu_hour, as the
completion record bills it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.config import RunConfig
from trainer.errors import CostCapReached, PreflightRefused

IDLE_FRACTION = 0.10  # of step time: evaluations, checkpoints, publishing (as `cost estimate`)
WARMUP_STEPS = 2  # first steps of a smoke run left out of its step time (allocation, caches)


@dataclass(frozen=True)
class Caps:
    """A run's cost and time caps, and the price they are computed with."""

    max_cost: float | None  # currency units
    max_hours: float | None  # wall-clock hours
    price_per_gpu_hour: float
    gpus: int
    currency: str = "USD"

    @classmethod
    def of(cls, config: RunConfig, gpus: int) -> Caps:
        """The caps of a run's config, for `gpus` GPUs."""
        return cls(
            config.max_cost, config.max_hours, config.price_per_gpu_hour, gpus, config.currency
        )

    @property
    def any(self) -> bool:
        return self.max_cost is not None or self.max_hours is not None

    def cost(self, hours: float) -> float:
        """The cost of `hours` on this run's GPUs."""
        return hours * self.gpus * self.price_per_gpu_hour


@dataclass(frozen=True)
class Estimate:
    """A run's estimated hours and cost, with the arithmetic behind them."""

    hours: float  # wall clock, the run's earlier sessions included
    cost: float  # currency units
    formula: str  # the arithmetic, with its numbers


def estimate(
    caps: Caps,
    *,
    steps_left: int,
    seconds_per_step: float,
    setup_hours: float,
    hours_so_far: float = 0.0,
) -> Estimate:
    """hours = so far + set-up + steps left x s/step x (1 + idle allowance) / 3600."""
    compute_h = steps_left * seconds_per_step * (1 + IDLE_FRACTION) / 3600
    hours = hours_so_far + setup_hours + compute_h
    formula = (
        f"{hours_so_far:.3g} h so far + {setup_hours:g} h set-up + {steps_left} steps x "
        f"{seconds_per_step:.3g} s x {1 + IDLE_FRACTION:g} = {hours:.3g} h"
    )
    if caps.price_per_gpu_hour:
        formula += (
            f" x {caps.gpus} GPU x {caps.price_per_gpu_hour:g} {caps.currency}/GPU-h "
            f"= {caps.cost(hours):.2f} {caps.currency}"
        )
    return Estimate(hours, caps.cost(hours), formula)


def overshoot(caps: Caps, hours: float) -> list[str]:
    """Each cap that `hours` of running would pass, with by how much (empty: within)."""
    out = []
    cost = caps.cost(hours)
    if caps.max_cost is not None and cost > caps.max_cost:
        over = cost - caps.max_cost
        out.append(
            f"cost {cost:.2f} {caps.currency} exceeds max_cost {caps.max_cost:g} by "
            f"{over:.2f} {caps.currency} ({over / caps.max_cost:.0%})"
        )
    if caps.max_hours is not None and hours > caps.max_hours:
        over = hours - caps.max_hours
        out.append(
            f"{hours:.3g} h exceeds max_hours {caps.max_hours:g} by {over:.3g} h "
            f"({over / caps.max_hours:.0%})"
        )
    return out


def measured_step_time(
    metrics_dir: Path, what: str, tokens_per_step: float | None = None
) -> tuple[float, str] | None:
    """Mean seconds per step of a run's warm steps (the first WARMUP_STEPS left out when
    enough remain) and where it came from; None without records. With `tokens_per_step`
    (another run's steps: the smoke run trains a smaller or shorter batch), the mean
    seconds per token of those steps times it, where every step recorded its tokens."""
    rows = []
    for p in metrics_dir.glob("metrics-step-*.json"):
        try:
            data = json.loads(p.read_text())
            rows.append((int(data["step"]), float(data["step_time_s"]), data.get("tokens")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    rows.sort()
    if not rows:
        return None
    warm = [r for r in rows if r[0] > WARMUP_STEPS] or rows[1:] or rows[:1]
    source = f"mean of {len(warm)} step(s) of {what} in {metrics_dir}"
    if tokens_per_step and all(isinstance(r[2], int) and r[2] > 0 for r in warm):
        per_token = statistics.fmean(t / n for _, t, n in warm)
        return per_token * tokens_per_step, (
            f"{source}, {per_token * 1000:.3g} ms a token x {tokens_per_step:.0f} tokens a step"
        )
    return statistics.fmean(t for _, t, _ in warm), source


class Meter:
    """Hours and cost of a run so far, from a clock (seconds; time.monotonic by default)
    and the hours of its earlier sessions. `check` is called after each optimizer step."""

    def __init__(
        self, caps: Caps, hours_before: float = 0.0, clock: Callable[[], float] | None = None
    ) -> None:
        self.caps = caps
        self.clock = clock or time.monotonic
        self.hours_before = hours_before
        self.started = self.clock()
        self._last = self.started

    def mark(self) -> None:
        """The steps begin: the first step's pace is not the set-up's."""
        self._last = self.clock()

    def seconds(self) -> float:
        """Seconds of this session."""
        return self.clock() - self.started

    def hours(self) -> float:
        """Hours of the run so far, earlier sessions included."""
        return self.hours_before + self.seconds() / 3600

    def cost(self) -> float:
        """Cost of the run so far, earlier sessions included."""
        return self.caps.cost(self.hours())

    def check(self) -> list[str]:
        """The caps the next step would pass, at the pace of the last one (empty: go on)."""
        now = self.clock()
        step_s, self._last = now - self._last, now
        hours = self.hours_before + (now - self.started + step_s) / 3600
        return overshoot(self.caps, hours) if self.caps.any else []


def check_preflight(
    caps: Caps,
    *,
    steps_left: int,
    timing: tuple[float, str] | None,
    setup_hours: float,
    hours_so_far: float = 0.0,
) -> str:
    """The preflight line of a capped run; PreflightRefused when its estimate passes a cap."""
    if timing is None:
        return (
            "cost cap: no measured step time yet (run with --smoke first, or set "
            "seconds_per_step); the cap is checked after every step"
        )
    sps, source = timing
    est = estimate(
        caps,
        steps_left=steps_left,
        seconds_per_step=sps,
        setup_hours=setup_hours,
        hours_so_far=hours_so_far,
    )
    over = overshoot(caps, est.hours)
    if over:
        raise PreflightRefused(
            "cost cap: the estimate passes the cap: "
            + "; ".join(over)
            + f"\n  estimate: {est.formula}\n  step time: {source}",
            "raise the cap (max_cost=..., max_hours=...), or shorten the run (max_steps, "
            "epochs) or make it cheaper (price_per_gpu_hour, a faster device)",
        )
    return f"cost cap: estimate {est.formula} ({source}); within the cap"


def stop_error(
    caps: Caps,
    meter: Meter,
    over: list[str],
    *,
    step: int,
    total_steps: int,
    checkpoint_ref: str,
    command: str,
    setup_hours: float,
) -> CostCapReached:
    """The error a run raises when it stops at its cap, naming the command that resumes it.
    The pace of the rest is the run's so far, set-up included (on the safe side)."""
    hours = meter.hours()
    raised = resume_overrides(caps, hours, total_steps - step, hours / max(1, step), setup_hours)
    spent = f"{caps.cost(hours):.2f} {caps.currency} in {hours:.3g} h"
    return CostCapReached(
        f"cost cap reached: stopped after step {step}/{total_steps} ({spent}); the next step "
        f"would pass it: {'; '.join(over)}.\n  checkpoint published: {checkpoint_ref}\n"
        f"  resume with: {command} --resume auto {raised}",
        "the resume command raises the cap to what the rest of the run should cost at this pace",
    )


def resume_overrides(
    caps: Caps, hours: float, steps_left: int, hours_per_step: float, setup_hours: float
) -> str:
    """The key=value overrides that let a stopped run finish: each cap raised to what the
    run has spent, plus a new set-up and the rest at its pace with the idle allowance (what
    the resumed run's preflight estimates, or more), rounded up."""
    need_h = hours + setup_hours + steps_left * hours_per_step * (1 + IDLE_FRACTION)
    out = []
    if caps.max_cost is not None:
        out.append(f"max_cost={_round_up(max(caps.cost(need_h), caps.max_cost))}")
    if caps.max_hours is not None:
        out.append(f"max_hours={_round_up(max(need_h, caps.max_hours))}")
    return " ".join(out)


def _round_up(x: float) -> float:
    """Up to two significant digits (12.34 -> 13, 0.1234 -> 0.13), never down."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return round(math.ceil(x / scale - 1e-9) * scale, 10)
