"""Real failures of a run leave the support memo a helper asks for first: an out-of-memory
mid-run, SIGTERM mid-run and a corrupted dataset line each write `support-bundle.json`
with the template text, the failing step, the batch shape, the last 20 log lines and the
knob to turn, and (once the store is open) publish it beside the run as OUTPUT/support."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lorastack.errors import LorastackError
from lorastack.store import open_store
from trainer.config import load_config
from trainer.errors import TrainingInterrupted, TrainingOOM
from trainer.recipe import Recipe, run_training
from trainer.settings import TrainerSettings


def _fail_at_step(monkeypatch: pytest.MonkeyPatch, step: int, fail: Callable[[], None]) -> None:
    real = Recipe._step_loss

    def step_loss(self: Recipe, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.progress.step + 1 == step:
            fail()
        return real(self, batch)

    monkeypatch.setattr(Recipe, "_step_loss", step_loss)


def _memo(settings: TrainerSettings, run: str) -> dict[str, Any]:
    path = settings.resolved_runs_dir / run / "support-bundle.json"
    memo: dict[str, Any] = json.loads(path.read_text())
    published = open_store(settings).resolve(f"{run}/support")
    assert published.kind == "report"
    assert [f.path for f in published.files] == ["support-bundle.json"]
    return memo


@pytest.mark.slow
def test_an_out_of_memory_mid_run_leaves_the_memo_with_the_knob_to_turn(
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_notarealtoken0123")

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    _fail_at_step(monkeypatch, 3, oom)
    cfg = load_config(write_config("memo-oom", demo_jsonl, eval_every=100))
    with pytest.raises(TrainingOOM) as err:
        run_training(cfg, trainer_env)
    assert "at step 3" in err.value.message and "micro_batch" in err.value.hint
    memo = _memo(trainer_env, "memo-oom")
    assert memo["failing_step"] == 3 and memo["oom"] is True
    assert (memo["max_seq_len"], memo["micro_batch"], memo["grad_accum"]) == (128, 2, 1)
    assert "<|im_start|>" in memo["template"]["text"]
    assert memo["exception"]["type"] == "OutOfMemoryError" and "micro_batch" in memo["hint"]
    assert 0 < len(memo["last_log_lines"]) <= 20
    assert any("step 2" in line for line in memo["last_log_lines"]), memo["last_log_lines"]
    assert memo["libraries"]["peft"] != "absent" and memo["device"].startswith("cpu")
    assert memo["environment"]["HF_TOKEN"] == "<redacted>"
    assert "hf_notarealtoken0123" not in json.dumps(memo)


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_and_leaves_the_memo_with_the_resume_command(
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fail_at_step(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    cfg = load_config(write_config("memo-sigterm", demo_jsonl, eval_every=100))
    with pytest.raises(TrainingInterrupted, match="SIGTERM received: stopped after step 3"):
        run_training(cfg, trainer_env)
    memo = _memo(trainer_env, "memo-sigterm")
    assert memo["step"] == 3 and memo["oom"] is False
    assert memo["exception"]["type"] == "TrainingInterrupted" and "--resume" in memo["hint"]
    assert open_store(trainer_env).versions("memo-sigterm/checkpoints")[-1] == "3"


def test_a_corrupted_dataset_line_is_named_and_leaves_the_memo(
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
) -> None:
    lines = demo_jsonl.read_text().splitlines()
    lines[15] = lines[15][: len(lines[15]) // 2]  # cut mid-line, as a failed copy leaves it
    demo_jsonl.write_text("\n".join(lines) + "\n")
    cfg = load_config(write_config("memo-corrupt", demo_jsonl))
    with pytest.raises(LorastackError) as err:
        run_training(cfg, trainer_env)
    assert f"{demo_jsonl}:16: not valid JSON" in err.value.message
    path = trainer_env.resolved_runs_dir / "memo-corrupt" / "support-bundle.json"
    memo = json.loads(path.read_text())
    assert f"{demo_jsonl}:16:" in memo["exception"]["message"] and memo["hint"] == err.value.hint
    assert memo["max_seq_len"] == 128 and memo["failing_step"] == 1
