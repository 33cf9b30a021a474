"""Batch order, micro-batch grouping (with or without packing), padding and the
learning-rate schedule.

Pure functions of (seed, epoch, step): the data position of a run is its step, so a
resumed run takes exactly the batches the uninterrupted run would have taken.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainer.config import RunConfig
from trainer.data.masking import IGNORE
from trainer.data.packing import collate_rows, pack_rows
from trainer.data.samples import Sample

WIDTH_MULTIPLE = 64  # tokens: unpacked batch widths of a compiled run round up to this


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """A permutation of range(n), fixed by (seed, epoch)."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n)]


class Plan:
    """Which samples each micro-batch of each optimizer step holds.

    A micro-batch is a list of rows and a row a list of sample indices: one sample per
    row, or, with `pack_to` (packing), as many as fit in `pack_to` tokens
    (trainer.data.packing). Rows follow the (seed, epoch) permutation; packed rows are then
    shuffled by (seed, epoch) too, so a row's position says nothing of its lengths.
    The last step of an epoch may hold fewer micro-batches, its last micro-batch fewer
    rows.
    """

    def __init__(
        self,
        seed: int,
        lengths: list[int],
        micro_batch: int,
        grad_accum: int,
        pack_to: int | None = None,
    ) -> None:
        self.seed, self.lengths, self.pack_to = seed, lengths, pack_to
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self._rows: dict[int, list[list[int]]] = {}

    def rows(self, epoch: int) -> list[list[int]]:
        """The rows of `epoch`, in order: each a list of sample indices (one, or packed)."""
        if epoch not in self._rows:
            order = epoch_order(self.seed, epoch, len(self.lengths))
            if self.pack_to is None:
                rows = [[i] for i in order]
            else:
                packed = pack_rows(order, self.lengths, self.pack_to)
                shuffle = np.random.default_rng([self.seed, epoch, 1]).permutation(len(packed))
                rows = [packed[int(k)] for k in shuffle]
            self._rows = {epoch: rows}  # one epoch at a time
        return self._rows[epoch]

    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch (the same in every epoch)."""
        # the same in every epoch: best-fit decreasing packs the same lengths into the
        # same number of rows whatever their order
        return math.ceil(math.ceil(len(self.rows(0)) / self.micro_batch) / self.grad_accum)

    def step(self, step: int) -> list[list[list[int]]]:
        """The micro-batches of optimizer step `step` (0-based)."""
        spe = self.steps_per_epoch()
        epoch, k = divmod(step, spe)
        rows, mb = self.rows(epoch), self.micro_batch
        micro = [rows[i : i + mb] for i in range(0, len(rows), mb)]
        return micro[k * self.grad_accum : (k + 1) * self.grad_accum]


def plan_batches(cfg: RunConfig, samples: list[Sample]) -> Plan:
    """The batch plan of a run over its training samples (packed rows when packing is on)."""
    lengths = [sample.length for sample in samples]
    pack_to = cfg.max_seq_len if cfg.packing else None
    return Plan(cfg.seed, lengths, cfg.micro_batch, cfg.grad_accum, pack_to)


def max_row_tokens(cfg: RunConfig, samples: list[Sample]) -> int:
    """Tokens in a row of the widest micro-batch: max_seq_len when packing, else the
    longest training sample."""
    if cfg.packing:
        return cfg.max_seq_len
    return max(sample.length for sample in samples)


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """The run's optimizer steps: its epochs, or `max_steps` when that comes first."""
    by_epochs = cfg.epochs * steps_per_epoch
    return min(cfg.max_steps, by_epochs) if cfg.max_steps else by_epochs


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def collate(samples: list[Sample], pad_id: int, width: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample (or `width`); padded positions are masked and
    IGNOREd."""
    width = max(width, *(s.length for s in samples))
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : s.length] = torch.tensor(s.input_ids)
        labels[row, : s.length] = torch.tensor(s.labels)
        attn[row, : s.length] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def collate_micro_batch(
    rows: list[list[Sample]], pad_id: int, pack_to: int | None, fixed_rows: int = 0
) -> dict[str, torch.Tensor]:
    """The tensors of one micro-batch (see Plan for rows).

    `fixed_rows` > 0 gives a compiled model few distinct shapes: the batch gets that many
    rows (the missing ones all padding, IGNOREd), and an unpacked batch's width is
    rounded up to a multiple of WIDTH_MULTIPLE (inductor guards on the width's
    alignment, so unaligned widths would compile again). Packed rows are `pack_to`
    wide already: one shape for the whole run."""
    rows = rows + [[] for _ in range(fixed_rows - len(rows))]
    if pack_to is not None:
        return collate_rows(rows, pad_id, pack_to)
    width = max(s.length for row in rows for s in row)
    if fixed_rows:
        width = -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    batch = collate([row[0] for row in rows if row], pad_id, width)
    missing = len(rows) - batch["input_ids"].shape[0]
    if missing:  # padding rows attend to themselves (a fully masked row gives NaN)
        batch["input_ids"] = torch.cat([batch["input_ids"], torch.full((missing, width), pad_id)])
        batch["labels"] = torch.cat([batch["labels"], torch.full((missing, width), IGNORE)])
        batch["attention_mask"] = torch.cat(
            [batch["attention_mask"], torch.ones((missing, width), dtype=torch.long)]
        )
    return batch


def supervised_count(samples: list[Sample]) -> int:
    """Tokens the loss counts: supervised labels after the one-position shift."""
    return sum(sum(1 for lab in s.labels[1:] if lab != IGNORE) for s in samples)
