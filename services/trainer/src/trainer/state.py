"""The state a run carries between its stages, each part a small typed value.

`RunPlan` is what the run is and what setup decided before the first step: the config
(as the mode and auto-batch left it), the settings, the mode, the folders, the device,
the samples, the batch plan and its steps, the run manifest, the published splits and
the memory plan. It is frozen: the recipe makes it with what the run is, and its setup
(trainer.recipe.Recipe.setup) adds, once, what its steps decided; every stage reads it.
`Components` is what setup builds once (trainer.assembly.build_model returns it): the
model with its LoRA weights, the loss module the steps call, the compiler, the optimizer
and the schedule.
`Progress` is what the steps move forward and a checkpoint keeps for a resume
(trainer.publish.resuming saves it and returns it restored). What one session changes
as it goes (the log, the meter, the live metrics, the last checkpoint, a stop signal) is
trainer.session's, which only the recipe holds. This module imports no other trainer
module at run time but the batch plan's (trainer.data.batching): every stage may take
these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.data.batching import Plan

if TYPE_CHECKING:
    from lorastack.manifest import Manifest
    from trainer.config import RunConfig
    from trainer.data.samples import Sample
    from trainer.model.compiling import CompileRun
    from trainer.settings import TrainerSettings


CPU = torch.device("cpu")


@dataclass(frozen=True)
class RunPlan:
    """What the run is, and what setup decided before the first step; nothing changes it
    after."""

    config: RunConfig  # smoke and overfit runs adjust steps and schedule, auto-batch the batch
    settings: TrainerSettings
    mode: str  # train | smoke | overfit (trainer.loop.modes)
    overfit: int | None  # --overfit N: the samples an overfit run trains on
    command: str  # how the run was started: the resume command repeats it
    run_dir: Path
    device: torch.device = CPU  # trainer.model.modeling.resolve_device
    # decided by setup
    eot: int = 0  # the end-of-turn token
    pad: int = 0  # the padding token (the end-of-turn token where the tokenizer has none)
    train_samples: list[Sample] = field(default_factory=list)  # the ones the mode selected
    val_samples: list[Sample] = field(default_factory=list)
    run_manifest: dict[str, Any] = field(default_factory=dict)  # what --resume compares
    data_manifest: Manifest | None = None  # <output>/data, published by a "train" run
    test_manifest: Manifest | None = None  # <output>/test
    memory_estimate: dict[str, int] = field(default_factory=dict)  # trainer.model.memory
    checkpointed: int = 0  # decoder layers recomputed in backward
    batches: Plan = field(default_factory=lambda: Plan(0, [], 1, 1))  # none before setup
    total_steps: int = 0

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def metrics_dir(self) -> Path:
        return self.run_dir / "metrics"


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
