"""The published adapter is the best evaluation's (select: best_val_loss), its checkpoint
survives keep_checkpoints, and early stopping stops once the validation loss stops
improving; the decisions are pure functions of the validation losses, so a resumed run
makes them as the uninterrupted one did."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lorastack.store import open_store
from trainer.config import load_config
from trainer.loop.selection import selected_step, should_stop, standing
from trainer.recipe import run_training
from trainer.settings import TrainerSettings


@pytest.mark.parametrize(
    ("losses", "min_delta", "best", "stale"),
    [
        ({}, 0.0, None, 0),
        ({10: 1.0}, 0.0, 10, 0),
        ({10: 1.0, 20: 0.9, 30: 0.95, 40: 0.97}, 0.0, 20, 2),
        ({10: 1.0, 20: 0.99, 30: 0.985}, 0.05, 30, 2),  # improvements smaller than min_delta
        ({10: 1.0, 20: 1.0}, 0.0, 10, 1),  # a tie is no improvement; the earliest is best
        ({30: 0.5, 10: 1.0, 20: 0.7}, 0.0, 30, 0),  # by step, not by insertion order
    ],
)
def test_standing(losses: dict[int, float], min_delta: float, best: int | None, stale: int) -> None:
    s = standing(losses, min_delta)
    assert (s.best_step, s.stale) == (best, stale)


def test_stop_and_select() -> None:
    losses = {10: 1.0, 20: 0.9, 30: 0.95, 40: 0.97}
    assert not should_stop(losses, patience=3, min_delta=0.0)
    assert should_stop(losses, patience=2, min_delta=0.0)
    assert selected_step(losses, "best_val_loss", 40) == (
        20,
        "lowest validation loss 0.9000 (the last step, 40: 0.9700)",
    )
    assert selected_step(losses, "last", 40)[0] == 40
    assert selected_step({}, "best_val_loss", 40) == (
        40,
        "the last step (no validation loss to select by)",
    )


def test_a_run_stops_early_and_publishes_its_best_checkpoint(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    # a learning rate that overshoots: the validation loss rises after its first fall
    cfg = load_config(
        write_config(
            "early",
            demo_jsonl,
            lr=0.05,
            max_steps=8,
            eval_every=1,
            checkpoint_every=100,
            keep_checkpoints=1,
            early_stopping={"patience": 2, "min_delta": 0.0},
        )
    )
    result = run_training(cfg, trainer_env)
    val = result.val_losses
    best = min(val, key=val.__getitem__)
    assert result.steps < 8 and best < result.steps, val  # stopped, and not at its best
    assert standing(val).stale == 2
    assert result.completion["selected"]["step"] == best
    assert result.adapter is not None
    meta = result.adapter.metadata
    assert meta["selected_step"] == best and "lowest validation loss" in meta["selected_because"]
    template = (result.run_dir / "adapter" / "chat_template.jinja").read_bytes()
    assert meta["chat_format"] == {  # what serving reads (inference.chat_format)
        "template": "",  # the base model's own
        "template_file": "chat_template.jinja",
        "template_sha256": hashlib.sha256(template).hexdigest(),
        "tools": False,
        "tool_call_parser": None,
    }
    # the best checkpoint outlived keep_checkpoints=1, here and in the store
    runs = trainer_env.resolved_runs_dir / "early" / "checkpoints"
    assert (runs / f"step-{best:08d}").is_dir()
    assert str(best) in open_store(trainer_env).versions("early/checkpoints")
    # and the published weights are that checkpoint's
    from safetensors.torch import load_file

    published = load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))
    kept = load_file(str(runs / f"step-{best:08d}" / "adapter" / "adapter_model.safetensors"))
    assert published.keys() == kept.keys()
    assert all(torch.equal(published[k], kept[k]) for k in kept)
