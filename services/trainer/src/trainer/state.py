"""The state a run carries between its stages, each part a small typed value.

`Components` is what setup builds once (trainer.assembly.build_model returns it): the
model with its LoRA weights, the loss module the steps call, the compiler, the optimizer
and the schedule. `Progress` is what the steps move forward and a checkpoint keeps for a
resume (trainer.publish.resuming saves it and returns it restored). This module imports
no other trainer module at run time: every stage may take these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.model.compiling import CompileRun


@dataclass
class Components:
    """What setup builds: fixed for the run (the weights and optimizer states change
    inside them, the objects do not)."""

    peft: Any  # the PEFT model (the LoRA weights train, save and load through it)
    compiler: CompileRun
    train_loss: Any  # LossModule, DDP-wrapped (FSDP-sharded) on several processes
    trainable: int  # LoRA parameters
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR


@dataclass
class Progress:
    """How far the run is, over all its sessions; a checkpoint saves it."""

    step: int = 0  # optimizer steps finished
    tokens_seen: int = 0  # input tokens (not padding) in finished steps
    supervised_seen: int = 0  # of those, tokens the loss counted
    wall_before: float = 0.0  # seconds spent in earlier sessions of a resumed run
    resumed_at: int | None = None  # the step a resumed run started from
    losses: dict[int, float] = field(default_factory=dict)  # {step: training loss}
    val_losses: dict[int, float] = field(default_factory=dict)  # {step: validation loss}

    def advance(self, loss: float, tokens: int, supervised: int) -> int:
        """Count one finished optimizer step; its number."""
        self.step += 1
        self.tokens_seen += tokens
        self.supervised_seen += supervised
        self.losses[self.step] = loss
        return self.step
