"""The HTTP side of the parity check (inference.parity) over plain data: what vLLM's
arguments say about the served base, and the margins read from vLLM's top log-probs."""

from __future__ import annotations

import pytest

from inference.parity import Forced, _forced_at, served_quantization


@pytest.mark.parametrize(
    ("args", "quantization"),
    [
        ([], "none"),
        (["--enforce-eager"], "none"),
        (["--quantization", "bitsandbytes"], "nf4"),  # vLLM quantises in flight to nf4
        (["--quantization=bitsandbytes", "--enforce-eager"], "nf4"),
        (["-q", "fp8"], "fp8"),
        (["--quantization"], "none"),  # no method given: vLLM itself refuses to start
    ],
)
def test_the_served_base_quantisation_is_read_from_vllms_arguments(
    args: list[str], quantization: str
) -> None:
    assert served_quantization(args) == quantization


def test_the_margin_is_how_far_the_server_preferred_its_own_token() -> None:
    top = {5: -0.1, 6: -0.5}
    assert _forced_at(top, 5, 5) == Forced(-0.1, True, 0.0, 5)
    assert _forced_at(top, 6, 5) == Forced(-0.5, False, pytest.approx(0.4), 5)
    # outside the server's top few: its log-prob is at most the least of them, margin unknown
    assert _forced_at(top, 7, 5) == Forced(-0.5, False, None, 5)
