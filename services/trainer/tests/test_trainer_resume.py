"""A run SIGKILLed after a checkpoint resumes to the same losses, bit for bit; a changed
dataset or an unsafe config change makes --resume refuse; a fresh start over existing
checkpoints refuses too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.chat_data import load_jsonl, write_jsonl
from lorastack.store import open_store
from trainer.config import load_config
from trainer.errors import ResumeRefused
from trainer.recipe import run_training
from trainer.records import read_series
from trainer.settings import TrainerSettings

CLI = [sys.executable, "-m", "lorastack.cli"]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "train", *args], capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_is_bitwise_exact(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    runs = trainer_env.resolved_runs_dir
    full = _train(str(write_config("full", demo_jsonl)))
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]

    cut_cfg = write_config("cut", demo_jsonl)
    # the run SIGKILLs itself once its step-2 checkpoint is durable: no timing decides
    killed = subprocess.run(
        [*CLI, "train", str(cut_cfg)], capture_output=True, text=True, timeout=1200,
        env={**os.environ, "LORASTACK_KILL_AFTER_CHECKPOINT": "2"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert (runs / "cut" / "checkpoints" / "step-00000002").is_dir()
    assert not (runs / "cut" / "training-complete.json").exists()

    # without --resume: refused, never a silent restart
    with pytest.raises(ResumeRefused, match="already has checkpoints"):
        run_training(load_config(cut_cfg), trainer_env)
    # a changed dataset: refused before any model loads, naming what changed
    convs = load_jsonl(demo_jsonl)
    convs[0].messages[-1].content = "1999-12-31"
    changed = demo_jsonl.with_name("changed.jsonl")
    write_jsonl(changed, convs)
    with pytest.raises(ResumeRefused, match="dataset_digest") as e:
        run_training(
            load_config(write_config("cut-changed", changed, output="cut")),
            trainer_env,
            resume=True,
        )
    assert "config.dataset.path" in e.value.message
    # an unsafe config change is refused; only declared-safe fields may differ
    with pytest.raises(ResumeRefused, match=r"config\.lr"):
        run_training(load_config(cut_cfg, ["lr=0.002"]), trainer_env, resume=True)

    resumed = _train(str(cut_cfg), "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    a = read_series(runs / "full" / "metrics", "metrics", "loss")
    b = read_series(runs / "cut" / "metrics", "metrics", "loss")
    assert list(a) == [1, 2, 3, 4, 5, 6] and a == b  # float equality: bit for bit
    # --resume of a finished run (a second `lorastack demo`) trains nothing, succeeds and
    # keeps the published adapter and the completion record as they were
    completed = (runs / "cut" / "training-complete.json").read_text()
    adapters = open_store(trainer_env).versions("cut/adapter")
    again = _train(str(cut_cfg), "--resume")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "had already finished at step 6; keeping cut/adapter:1" in again.stdout
    assert open_store(trainer_env).versions("cut/adapter") == adapters == ["1"]
    assert (runs / "cut" / "training-complete.json").read_text() == completed
    assert read_series(runs / "cut" / "metrics", "metrics", "loss") == b
    assert read_series(runs / "full" / "metrics", "eval", "val_loss") == read_series(
        runs / "cut" / "metrics", "eval", "val_loss"
    )
    from safetensors.torch import load_file

    wa = load_file(str(runs / "full" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(runs / "cut" / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
