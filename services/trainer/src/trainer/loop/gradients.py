"""One optimizer step's batches, gradients and update.

step_batches takes the step's micro-batches from the batch plan (refusing a step with no
supervised token); accumulate runs this process's share of them
(trainer.model.distributed.my_share), each collated, its loss scaled to the step's
supervised tokens on all processes and run backward, with the gradient sync (DDP's,
FSDP's) only on the last one, and returns the step's loss summed over processes;
optimizer_step clips the gradients and steps the optimizer and the schedule. The order of
the step's parts is trainer.recipe.Recipe.train's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from trainer.data.batching import Plan, collate_micro_batch, supervised_count
from trainer.data.samples import Sample
from trainer.errors import SmokeFailed
from trainer.model.compiling import mark_dynamic_samples, mark_dynamic_width
from trainer.model.cross_entropy import loss_positions
from trainer.model.distributed import my_share, sum_over_ranks, syncing
from trainer.state import Components, RunPlan


class StepBatches(NamedTuple):
    """One optimizer step's samples, as step_batches returns them."""

    micro_batches: list[list[list[Sample]]]  # [micro-batch][row][sample], all processes
    supervised_tokens: int  # tokens the loss counts, whole step, all processes
    input_tokens: int  # tokens fed in (not padding), whole step, all processes


class OptimizerStep(NamedTuple):
    """What optimizer_step reports about the step it took."""

    grad_norm: torch.Tensor  # before clipping, on the device: reading it waits for the GPU
    lr: float  # the learning rate the step used


def step_batches(plan: Plan, samples: list[Sample], step: int) -> StepBatches:
    """The micro-batches of the step after `step` (all processes), with its supervised and
    input token counts.

    Raises SmokeFailed when no token of the step is supervised (nothing to learn).
    """
    batches = [[[samples[i] for i in row] for row in mb] for mb in plan.step(step)]
    flat = [s for mb in batches for row in mb for s in row]
    n_sup = supervised_count(flat)  # the whole step, all ranks
    if n_sup == 0:
        raise SmokeFailed(
            f"step {step + 1} has no supervised token: every label is masked",
            "check the masking (lorastack data inspect) and loss_on",
        )
    return StepBatches(batches, n_sup, sum(s.length for s in flat))


def accumulate(
    run: RunPlan,
    components: Components,
    loss_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    batches: list[list[list[Sample]]],
    n_sup: int,
) -> torch.Tensor:
    """Run backward over this process's micro-batches of the step; return the step's loss
    per supervised token, summed over processes.

    `loss_of` gives a collated batch's loss summed over its supervised tokens; `n_sup` is
    the step's supervised tokens on all processes. Between micro-batches nothing waits for
    the GPU, so the host collates and copies the next one while the last one computes. On
    one process the loss comes back on the device, unread (the caller's read is the step's
    first wait for the GPU); on several, it is read once after the last micro-batch
    (`.item()` waits for this process's backward), summed over processes, and comes back
    on the host.
    """
    cfg, device, pad = run.config, run.device, run.pad
    world = run.settings.world_size
    compiled = components.compiler.active
    pack_to = cfg.max_seq_len if cfg.packing else None
    fixed_rows = cfg.micro_batch if compiled else 0  # few shapes for the compiler
    mine = my_share(batches, run.settings.rank, world)
    step_loss = torch.zeros((), device=device)
    for j, (b, weight) in enumerate(mine):
        tensors = collate_micro_batch(b, pad, pack_to, fixed_rows)
        tensors["loss_positions"] = loss_positions(tensors["labels"])
        batch = {k: to_device(v, device) for k, v in tensors.items()}
        if compiled:
            (mark_dynamic_width if pack_to is None else mark_dynamic_samples)(batch)
        with syncing(components.train_loss, j == len(mine) - 1):
            # DDP averages gradients over processes: * world gives their sum
            loss = loss_of(batch) / n_sup * world
            if weight != 1.0:
                loss = loss * weight
            loss.backward()
        step_loss += loss.detach() / world
    if world > 1:
        return torch.tensor(sum_over_ranks(step_loss.item(), device))
    return step_loss


def optimizer_step(components: Components, max_grad_norm: float) -> OptimizerStep:
    """Clip the gradients, step the optimizer and the schedule, clear the gradients;
    the gradient norm before clipping (on the device: reading it waits for the GPU) and
    the learning rate the step used."""
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in components.peft.parameters() if p.requires_grad], max_grad_norm
    )
    lr = float(components.scheduler.get_last_lr()[0])
    components.optimizer.step()
    components.scheduler.step()
    components.optimizer.zero_grad(set_to_none=True)
    return OptimizerStep(grad_norm, lr)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from pinned memory to a GPU, so that the copy does not wait for
    the kernels queued before it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
