"""One optimizer step's batches and gradients: the step's micro-batches from the plan
(refused when no token is supervised), this process's share of the step's micro-batches
(trainer.model.distributed.my_share), each collated, its loss scaled to the step's supervised
tokens (all processes) and run backward, with the gradient sync (DDP's, FSDP's) only on
the last one;
the step's loss, summed over processes. Clipping and the optimizer step stay in
trainer.recipe.Recipe.train.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.data.batching import collate_micro_batch, supervised_count
from trainer.data.samples import Sample
from trainer.errors import SmokeFailed
from trainer.model.compiling import mark_dynamic_samples, mark_dynamic_width
from trainer.model.cross_entropy import loss_positions
from trainer.model.distributed import my_share, sum_over_ranks, syncing

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def step_batches(r: Recipe) -> tuple[list[list[list[Sample]]], int, int]:
    """The micro-batches of this step (all processes), its supervised tokens and its input
    tokens; refuses a step with nothing to learn."""
    batches = [
        [[r.train_samples[i] for i in row] for row in mb] for mb in r.plan.step(r.progress.step)
    ]
    flat = [s for mb in batches for row in mb for s in row]
    n_sup = supervised_count(flat)  # the whole step, all ranks
    if n_sup == 0:
        raise SmokeFailed(
            f"step {r.progress.step + 1} has no supervised token: every label is masked",
            "check the masking (lorastack data inspect) and loss_on",
        )
    return batches, n_sup, sum(s.length for s in flat)


def accumulate(r: Recipe, batches: list[list[list[Sample]]], n_sup: int) -> torch.Tensor:
    """Backward over this process's micro-batches of the step; the step's loss per
    supervised token (all processes), on the device: nothing here waits for the GPU, so
    the host collates and copies the next micro-batch while the last one computes."""
    world = r.settings.world_size
    compiled = r.parts.compiler.active
    pack_to = r.config.max_seq_len if r.config.packing else None
    fixed_rows = r.config.micro_batch if compiled else 0  # few shapes for the compiler
    mine = my_share(batches, r.settings.rank, world)
    step_loss = torch.zeros((), device=r.device)
    for j, (b, weight) in enumerate(mine):
        tensors = collate_micro_batch(b, r.pad, pack_to, fixed_rows)
        tensors["loss_positions"] = loss_positions(tensors["labels"])
        batch = {k: to_device(v, r.device) for k, v in tensors.items()}
        if compiled:
            (mark_dynamic_width if pack_to is None else mark_dynamic_samples)(batch)
        with syncing(r.parts.train_loss, j == len(mine) - 1):
            # DDP averages gradients over processes: * world gives their sum
            loss = r._step_loss(batch) / n_sup * world
            if weight != 1.0:
                loss = loss * weight
            loss.backward()
        step_loss += loss.detach() / world
    if world > 1:
        return torch.tensor(sum_over_ranks(step_loss.item(), r.device))
    return step_loss


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from pinned memory to a GPU, so that the copy does not wait for
    the kernels queued before it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
