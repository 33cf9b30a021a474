"""The parity reference stops where vLLM stops: at any end-of-sequence token of the
model's generation config (an id or a list, as Llama 3's [128001, 128008, 128009]), not
only the tokenizer's, so a recorded answer never runs past a token vLLM ends on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.publish.reference import recording_quantization, stop_ids


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


LLAMA_8B = {  # config.json of Llama-3.1-8B: 8.0e9 parameters, 16.1 GB in bfloat16
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    ("quantization", "free_gb", "recorded_on"),
    [
        ("nf4", 80.0, "none"),  # an H100 beside the 8B QLoRA run: the served base
        ("nf4", 18.8, "none"),  # 16.1 GB x 1.1 + 1 GiB = 18.7 GB: just fits
        ("nf4", 18.6, "nf4"),  # just does not: the base it trained on, and why
        ("none", 1.0, "none"),  # a LoRA run is recorded as trained
        ("nf4", None, "none"),  # the CPU: not measured, tried
    ],
)
def test_a_qlora_reference_is_recorded_on_the_served_base_when_it_fits(
    quantization: str, free_gb: float | None, recorded_on: str
) -> None:
    """A QLoRA adapter is served on the unquantised base (vLLM, the merge): its reference is
    recorded there, in the compute dtype, unless that base does not fit the memory left."""
    config = SimpleNamespace(quantization=quantization)
    free = None if free_gb is None else int(free_gb * 1e9)
    got, why = recording_quantization(config, LLAMA_8B, torch.device("cuda", 0), free)  # type: ignore[arg-type]
    assert got == recorded_on
    assert bool(why) == (recorded_on == "nf4") and ("18.7 GB" in why or not why), why
