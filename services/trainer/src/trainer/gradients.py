"""One optimizer step's batches and gradients: the step's micro-batches from the plan
(refused when no token is supervised), this process's share of the step's micro-batches
(trainer.distributed.my_share), each collated, its loss scaled to the step's supervised
tokens (all processes) and run backward, with the gradient sync (DDP's, FSDP's) only on
the last one;
the step's loss, summed over processes. Clipping and the optimizer step stay in
trainer.recipe.Recipe.train.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.batching import collate_micro_batch, supervised_count
from trainer.compiling import mark_dynamic_samples, mark_dynamic_width
from trainer.distributed import my_share, sum_over_ranks, syncing
from trainer.errors import SmokeFailed
from trainer.samples import Sample

if TYPE_CHECKING:
    from trainer.recipe import Recipe


def step_batches(r: Recipe) -> tuple[list[list[list[Sample]]], int, int]:
    """The micro-batches of this step (all processes), its supervised tokens and its input
    tokens; refuses a step with nothing to learn."""
    batches = [[[r.train_samples[i] for i in row] for row in mb] for mb in r.plan.step(r.step)]
    flat = [s for mb in batches for row in mb for s in row]
    n_sup = supervised_count(flat)  # the whole step, all ranks
    if n_sup == 0:
        raise SmokeFailed(
            f"step {r.step + 1} has no supervised token: every label is masked",
            "check the masking (lorastack data inspect) and loss_on",
        )
    return batches, n_sup, sum(s.length for s in flat)


def accumulate(r: Recipe, batches: list[list[list[Sample]]], n_sup: int) -> float:
    """Backward over this process's micro-batches of the step; the step's loss per
    supervised token (all processes)."""
    world = r.settings.world_size
    compiled = r.compiler.active
    pack_to = r.config.max_seq_len if r.config.packing else None
    fixed_rows = r.config.micro_batch if compiled else 0  # few shapes for the compiler
    mine = my_share(batches, r.settings.rank, world)
    step_loss = 0.0
    for j, (b, weight) in enumerate(mine):
        tensors = collate_micro_batch(b, r.pad, pack_to, fixed_rows)
        batch = {k: v.to(r.device) for k, v in tensors.items()}
        if compiled:
            (mark_dynamic_width if pack_to is None else mark_dynamic_samples)(batch)
        with syncing(r.train_loss, j == len(mine) - 1):
            # DDP averages gradients over processes: * world gives their sum
            loss = r._step_loss(batch) / n_sup * world
            if weight != 1.0:
                loss = loss * weight
            loss.backward()
        step_loss += loss.item() / world
    if world > 1:
        step_loss = sum_over_ranks(step_loss, r.device)
    return step_loss
