"""--smoke passes on the embedded model and fails on a broken set-up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.errors import SmokeFailed
from trainer.recipe import run_training
from trainer.settings import TrainerSettings


@pytest.mark.slow
def test_smoke_passes_on_the_embedded_model(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    cfg = write_config("smoke-ok", demo_jsonl)
    r = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "train", str(cfg), "--smoke"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS (smoke)" in r.stdout and "stopped at end-of-turn" in r.stdout
    assert (trainer_env.resolved_runs_dir / "smoke-ok" / "smoke" / "loss.png").is_file()


@pytest.mark.slow
def test_smoke_fails_when_the_set_up_cannot_learn(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    # a learning rate 10^6 too small (a typo) leaves the loss flat: the verdict is FAIL
    cfg = load_config(write_config("smoke-bad", demo_jsonl), ["lr=1e-9"])
    with pytest.raises(SmokeFailed, match="BAD loss went down"):
        run_training(cfg, trainer_env, smoke=True)
