"""The cost cap: the preflight refuses a run whose estimate passes max_cost or max_hours
(saying by how much); a run that reaches its cap stops at a published checkpoint, names
the command that resumes it, and that command finishes with the adapter an uncapped run
publishes, bit for bit."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.errors import ConfigError
from lorastack.store import open_store
from trainer.config import build_config, load_config
from trainer.errors import CostCapReached, PreflightRefused
from trainer.loop import budget
from trainer.recipe import run_training
from trainer.settings import TrainerSettings

CAPS = budget.Caps(max_cost=10.0, max_hours=None, price_per_gpu_hour=2.0, gpus=2)


def test_the_estimate_adds_set_up_and_idle_allowance_and_says_the_overshoot() -> None:
    est = budget.estimate(CAPS, steps_left=1000, seconds_per_step=9.0, setup_hours=0.25)
    assert est.hours == pytest.approx(0.25 + 1000 * 9.0 * 1.1 / 3600)  # 3.0 h
    assert est.cost == pytest.approx(3.0 * 2 * 2.0)  # 12 units on 2 GPUs
    assert budget.overshoot(CAPS, est.hours) == [
        "cost 12.00 USD exceeds max_cost 10 by 2.00 USD (20%)"
    ]
    hours_cap = budget.Caps(None, 2.0, 0.0, 1)
    assert budget.overshoot(hours_cap, 3.0) == ["3 h exceeds max_hours 2 by 1 h (50%)"]
    assert budget.overshoot(hours_cap, 1.9) == []
    with pytest.raises(PreflightRefused, match=r"exceeds max_cost 10 by 2\.00 USD") as e:
        budget.check_preflight(
            CAPS, steps_left=1000, timing=(9.0, "given"), setup_hours=0.25, hours_so_far=0.0
        )
    assert "1000 steps x 9 s" in e.value.message and "raise the cap" in e.value.hint
    ok = budget.check_preflight(CAPS, steps_left=500, timing=(9.0, "given"), setup_hours=0.25)
    assert "within the cap" in ok
    assert "no measured step time" in budget.check_preflight(
        CAPS, steps_left=500, timing=None, setup_hours=0.25
    )


def test_the_meter_stops_before_the_step_that_would_pass_the_cap() -> None:
    ticks = iter([0.0, 0.0, 600.0, 1200.0, 1800.0])  # seconds: 10 minutes a step
    meter = budget.Meter(budget.Caps(1.0, None, 2.0, 1), clock=lambda: next(ticks))
    meter.mark()
    assert meter.check() == []  # 1/6 h spent, 1/3 h after the next step: 0.67 of 1.0
    assert meter.check() == []  # after the next: 0.5 h = 1.0, not more
    assert meter.check() == ["cost 1.33 USD exceeds max_cost 1 by 0.33 USD (33%)"]
    assert budget.resume_overrides(meter.caps, 0.5, 10, 1 / 6, 0.25) == "max_cost=5.2"


def test_the_stop_names_its_checkpoint_and_the_command_that_resumes_it() -> None:
    ticks = iter([0.0, 1800.0])  # half an hour at 2 USD/h: 1 USD spent
    meter = budget.Meter(budget.Caps(1.0, None, 2.0, 1), clock=lambda: next(ticks))
    err = budget.stop_error(
        meter.caps,
        meter,
        ["cost 1.10 USD exceeds max_cost 1 by 0.10 USD (10%)"],
        step=3,
        total_steps=10,
        checkpoint_ref="r/checkpoints:3",
        command="lorastack train c.yaml",
        setup_hours=0.25,
    )
    assert err.exit_code == 4
    assert err.message == (
        "cost cap reached: stopped after step 3/10 (1.00 USD in 0.5 h); the next step would "
        "pass it: cost 1.10 USD exceeds max_cost 1 by 0.10 USD (10%).\n"
        "  checkpoint published: r/checkpoints:3\n"
        # 0.5 h + 0.25 h set-up + 7 steps x 1/6 h x 1.1 = 2.03 h x 2 USD/h = 4.07 -> 4.1
        "  resume with: lorastack train c.yaml --resume auto max_cost=4.1"
    )


def test_step_time_comes_from_the_warm_steps_of_a_measured_run(tmp_path: Path) -> None:
    assert budget.measured_step_time(tmp_path, "the smoke run") is None
    for step, t in enumerate([5.0, 3.0, 1.0, 1.5], start=1):
        (tmp_path / f"metrics-step-{step}.json").write_text(
            json.dumps({"step": step, "step_time_s": t})
        )
    sps, source = budget.measured_step_time(tmp_path, "the smoke run") or (0.0, "")
    assert sps == pytest.approx(1.25) and "2 step(s) of the smoke run" in source


def test_a_smoke_runs_step_time_scales_by_tokens_to_the_runs_steps(tmp_path: Path) -> None:
    """The smoke run trains a smaller batch of short samples: its time per token, times the
    tokens of the run's steps."""
    for step, (t, n) in enumerate([(5.0, 100), (3.0, 100), (1.0, 100), (3.0, 200)], start=1):
        (tmp_path / f"metrics-step-{step}.json").write_text(
            json.dumps({"step": step, "step_time_s": t, "tokens": n})
        )
    sps, source = budget.measured_step_time(tmp_path, "the smoke run", 400.0) or (0.0, "")
    assert sps == pytest.approx((0.01 + 0.015) / 2 * 400)  # warm steps 3 and 4
    assert "tokens a step" in source


def test_a_cap_needs_a_price() -> None:
    with pytest.raises(ConfigError, match="max_cost needs price_per_gpu_hour"):
        build_config({"dataset": {"path": "x.jsonl"}, "max_cost": 5})


def test_a_run_over_its_cap_is_refused_at_preflight(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    cfg = load_config(
        write_config(
            "budget-refused", demo_jsonl, price_per_gpu_hour=2.0, max_cost=0.5, seconds_per_step=10
        )
    )
    with pytest.raises(PreflightRefused, match=r"exceeds max_cost 0\.5 by 0\.0\d USD"):
        run_training(cfg, trainer_env)
    assert not open_store(trainer_env).versions("budget-refused/checkpoints")


@pytest.mark.slow
def test_a_run_stops_at_its_cap_and_the_resume_command_finishes_it_exactly(
    tmp_path: Path,
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    fields = {"price_per_gpu_hour": 60.0, "eval_every": 100, "max_steps": 4}  # 1 USD a minute
    full = run_training(load_config(write_config("budget-full", demo_jsonl, **fields)), trainer_env)
    marker = tmp_path / "on_failure.env"
    on_failure = {"command": f"env | grep ^LORASTACK_ > {marker}", "allow_local_store": True}
    path = write_config("budget-capped", demo_jsonl, max_cost=14.0, on_failure=on_failure, **fields)
    clock = itertools.count(0.0, 60.0)  # a fake minute passes at every reading
    with pytest.raises(CostCapReached) as e:
        run_training(load_config(path), trainer_env, clock=lambda: next(clock), command="CMD")
    stopped = int(re.search(r"stopped after step (\d)/4", e.value.message)[1])  # type: ignore[index]
    assert 0 < stopped < 4
    assert f"checkpoint published: budget-capped/checkpoints:{stopped}" in e.value.message
    assert str(stopped) in open_store(trainer_env).versions("budget-capped/checkpoints")
    assert re.search(r"cost \d+\.\d\d/14\b", capsys.readouterr().out)  # in every step line
    # on_failure ran once the support memo and that checkpoint were verified in the store
    env = dict(line.split("=", 1) for line in marker.read_text().splitlines())
    assert env["LORASTACK_STATUS"] == "cost_cap" and env["LORASTACK_SUPPORT_REF"]
    assert env["LORASTACK_CHECKPOINT_REF"] == f"budget-capped/checkpoints:{stopped}"
    resume = re.search(r"resume with: CMD --resume auto (max_cost=\S+)", e.value.message)
    assert resume is not None

    resumed = run_training(load_config(path, [resume[1]]), trainer_env, resume=True)
    assert resumed.losses == {k: v for k, v in full.losses.items() if k > stopped}
    from safetensors.torch import load_file

    runs = trainer_env.resolved_runs_dir
    wa = load_file(str(runs / "budget-full" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(runs / "budget-capped" / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
