"""Sample packing: several samples in one row of `max_seq_len` tokens, none attending
across a boundary.

Pure functions. `pack_rows` groups sample indices into rows (best-fit decreasing, like
TRL's `bfd` strategy: on a long-tailed length mix it leaves a few percent of each row
empty, where padding every micro-batch to its longest sample left about half). `collate_rows`
lays the rows out as one tensor batch: position ids restart at 0 at each sample, which
is how transformers' mask builder (`find_packed_sequence_indices`) and the loss tell the
samples apart, and each sample's first label is IGNORE, so the last token of one
sample never learns to predict the first token of the next. The loss of a packed row is
the sum of its samples' losses computed alone (services/trainer/tests/test_trainer_packing.py).
"""

from __future__ import annotations

import bisect

import torch

from trainer.data.masking import IGNORE
from trainer.data.samples import Sample


def pack_rows(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices, each row's lengths summing to at most `capacity`.

    Best-fit decreasing over `order` (longest first; ties keep `order`): each sample goes
    to the fullest row it still fits in. The rows come back in the order they were
    opened, and each row lists its samples in `order`'s order, so the result is a pure
    function of (order, lengths, capacity).
    """
    rank = {i: k for k, i in enumerate(order)}
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row index), sorted
    for i in sorted(order, key=lambda i: (-lengths[i], rank[i])):
        if lengths[i] > capacity:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than a row's {capacity}")
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            left, row = capacity - lengths[i], len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(free, (left, row))
    return [sorted(r, key=rank.__getitem__) for r in rows]


def collate_rows(rows: list[list[Sample]], pad_id: int, width: int) -> dict[str, torch.Tensor]:
    """One batch of packed rows, each padded to `width` tokens.

    Returns input_ids, position_ids (restarting at 0 at each sample, and for the padding
    after the last one), labels (IGNORE at each sample's first token and on padding) and
    cu_seq_lens (sample_offsets: what variable-length attention takes, trainer.model.attention).
    No attention_mask: transformers builds the block-diagonal causal mask from the
    position ids."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            end = at + s.length
            if end > width:
                raise ValueError(f"row {r} holds {end} tokens, more than the width {width}")
            ids[r, at:end] = torch.tensor(s.input_ids)
            labels[r, at + 1 : end] = torch.tensor(s.labels[1:])
            pos[r, at:end] = torch.arange(s.length)
            at = end
        pos[r, at:] = torch.arange(width - at)
    return {
        "input_ids": ids,
        "position_ids": pos,
        "labels": labels,
        "cu_seq_lens": sample_offsets(pos),
    }


def sample_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """Where each sample starts in the flattened rows, then their total (int32): a
    sample starts where its position id is 0, a row's trailing padding included (it
    attends only to itself)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    return torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
