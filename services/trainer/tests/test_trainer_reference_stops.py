"""The parity reference stops where vLLM stops: at any end-of-sequence token of the
model's generation config (an id or a list, as Llama 3's [128001, 128008, 128009]), not
only the tokenizer's, so a recorded answer never runs past a token vLLM ends on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.publish.reference import stop_ids


@pytest.mark.parametrize(
    ("generation_eos", "tokenizer_eos", "stops"),
    [
        ([128001, 128008, 128009], 128009, [128001, 128008, 128009]),
        (2, 2, [2]),
        (7, 2, [2, 7]),
        (None, 2, [2]),
    ],
)
def test_the_reference_stops_at_every_end_token_vllm_stops_at(
    generation_eos: int | list[int] | None, tokenizer_eos: int, stops: list[int]
) -> None:
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=generation_eos))
    assert stop_ids(model, SimpleNamespace(eos_token_id=tokenizer_eos)) == stops
