"""Batch order, micro-batch grouping, padding and the learning-rate schedule.

Pure functions of (seed, epoch, step): the data position of a run is its step, so a
resumed run takes exactly the batches the uninterrupted run would have taken.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainer.masking import IGNORE
from trainer.samples import Sample


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """A permutation of range(n), fixed by (seed, epoch)."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n)]


def steps_per_epoch(n: int, micro_batch: int, grad_accum: int) -> int:
    return math.ceil(math.ceil(n / micro_batch) / grad_accum)


def step_micro_batches(
    seed: int, step: int, n: int, micro_batch: int, grad_accum: int
) -> list[list[int]]:
    """Sample indices of each micro-batch of optimizer step `step` (0-based).
    The last step of an epoch may hold fewer micro-batches."""
    spe = steps_per_epoch(n, micro_batch, grad_accum)
    epoch, k = divmod(step, spe)
    order = epoch_order(seed, epoch, n)
    micro = [order[i : i + micro_batch] for i in range(0, n, micro_batch)]
    return micro[k * grad_accum : (k + 1) * grad_accum]


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


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; padded positions are masked and IGNOREd."""
    width = max(s.length for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : s.length] = torch.tensor(s.input_ids)
        labels[row, : s.length] = torch.tensor(s.labels)
        attn[row, : s.length] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def supervised_count(samples: list[Sample]) -> int:
    """Tokens the loss counts: supervised labels after the one-position shift."""
    return sum(sum(1 for lab in s.labels[1:] if lab != IGNORE) for s in samples)
