"""Next-token cross-entropy without materialising the full logits.

The plain path computes `[batch, seq, vocab]` logits, upcasts them to fp32 and keeps
them for backward: for a 128k vocabulary at 2,048 tokens that is 1 GiB of fp32 logits
plus their gradient, per sequence. Here only supervised positions go through the
output projection, in chunks of about `CHUNK_ELEMENTS` logits, and each chunk is
recomputed in backward (activation checkpointing), so one chunk's logits are alive at a
time. Same code on CPU and CUDA; the result equals the plain path up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
CHUNK_ELEMENTS = 1 << 25  # logits per chunk: 32 Mi elements = 128 MiB in fp32


def _chunk_ce(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight)  # [rows, vocab]
    wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32: a stable softmax
    return F.cross_entropy(logits.to(wide), target, reduction="sum")


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions of the flattened [batch * seq] inputs whose next label is supervised,
    computed where `labels` lives (the host, at collation): given to
    linear_cross_entropy_sum, the device needs no boolean mask, whose count synchronises
    the host with the GPU (twice in forward, once in backward, each micro-batch)."""
    b, t = torch.nonzero(labels[:, 1:] != IGNORE, as_tuple=True)
    return b * labels.shape[1] + t


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of CE(hidden[t] @ weight.T, labels[t+1]) over positions whose label is supervised.

    hidden: [batch, seq, dim] final hidden states; weight: [vocab, dim] output projection;
    labels: [batch, seq] aligned with the inputs, IGNORE where not supervised;
    positions: loss_positions(labels) on hidden's device, if known (no host sync).
    """
    if positions is None:
        target = labels[:, 1:]
        keep = target != IGNORE
        rows = hidden[:, :-1][keep]  # [n_supervised, dim]
        tgt = target[keep]
    else:
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        tgt = labels.reshape(-1).index_select(0, positions + 1)
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    step = max(1, chunk_elements // weight.shape[0])
    for start in range(0, rows.shape[0], step):
        part = checkpoint(
            _chunk_ce,
            rows[start : start + step],
            weight,
            tgt[start : start + step],
            use_reentrant=False,
        )
        total = total + part
    return total
