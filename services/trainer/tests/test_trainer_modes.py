"""--overfit and `train sweep` on the embedded model: they do what the README says."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.store import open_store
from trainer.config import load_config
from trainer.loop.modes import OVERFIT_LOSS
from trainer.recipe import run_training
from trainer.settings import TrainerSettings


@pytest.mark.slow
def test_overfit_drives_the_loss_under_the_bar_and_publishes_nothing(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    cfg = load_config(write_config("overfit", demo_jsonl), ["lr=3e-3", "lora.r=8"])
    result = run_training(cfg, trainer_env, overfit=2)
    assert result.verdict is not None and result.verdict["passed"], result.verdict
    assert result.losses[result.steps] < OVERFIT_LOSS < result.losses[1]
    assert result.adapter is None
    assert open_store(trainer_env).versions("overfit/adapter") == []


@pytest.mark.slow
def test_sweep_trains_one_adapter_per_rank_and_prints_the_table(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    cfg = write_config("sweep", demo_jsonl)
    cmd = ["train", "sweep", str(cfg), "--ranks", "2,4", "max_steps=2", "eval_every=2"]
    r = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", *cmd],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+([\d,]+)\s+[\d.]+s\s+([\d.]+)\s", r.stdout, re.M)
    assert [int(rank) for rank, _, _ in rows] == [2, 4]
    params = [int(p.replace(",", "")) for _, p, _ in rows]
    assert params[1] == 2 * params[0]  # LoRA parameters grow linearly with the rank
    store = open_store(trainer_env)
    for rank in (2, 4):
        assert store.versions(f"sweep-r{rank}/adapter") == ["1"]
