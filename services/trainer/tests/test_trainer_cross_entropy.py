"""The fast path's loss equals the plain full-logits loss, in value and in gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.model.cross_entropy import IGNORE, linear_cross_entropy_sum, loss_positions


@pytest.mark.parametrize("chunk_elements", [1 << 27, 7 * 50])  # one chunk; many uneven chunks
@pytest.mark.parametrize("host_positions", [False, True])  # boolean mask on the device, or not
def test_chunked_cross_entropy_matches_full_logits(
    chunk_elements: int, host_positions: bool
) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11))
    labels[0, :4] = IGNORE  # a masked prompt
    labels[2, :] = IGNORE  # a fully masked row
    positions = loss_positions(labels) if host_positions else None
    fast = linear_cross_entropy_sum(hidden, weight, labels, chunk_elements, positions)
    g_fast = torch.autograd.grad(fast, (hidden, weight))
    logits = (hidden @ weight.T)[:, :-1]
    plain = F.cross_entropy(
        logits.reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    g_plain = torch.autograd.grad(plain, (hidden, weight))
    assert torch.allclose(fast, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_fast, g_plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_nothing_supervised_gives_zero_loss() -> None:
    hidden = torch.randn(1, 5, 8)
    labels = torch.full((1, 5), IGNORE)
    assert float(linear_cross_entropy_sum(hidden, torch.randn(10, 8), labels)) == 0.0


def test_loss_positions_index_the_flattened_inputs_whose_next_label_counts() -> None:
    labels = torch.tensor([[IGNORE, IGNORE, 5, 6], [IGNORE, 7, IGNORE, IGNORE]])
    # row 0: inputs 1 and 2 predict the supervised 5 and 6; row 1: input 0 predicts 7
    assert loss_positions(labels).tolist() == [1, 2, 4]
