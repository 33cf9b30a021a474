"""The memory estimate of a device when FSDP shards the model over N processes."""

from __future__ import annotations

from trainer.memory import estimate

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip


def test_sharding_divides_the_weights_and_lora_state_and_adds_what_is_gathered() -> None:
    kw = {"r": 16, "targets": ["q_proj", "v_proj"], "quantization": "none", "compute_bytes": 2,
          "micro_batch": 1, "seq_len": 2048, "gradient_checkpointing": True}  # fmt: skip
    one, eight = estimate(LLAMA_8B, **kw), estimate(LLAMA_8B, **kw, shards=8)  # type: ignore[arg-type]
    assert one["gathered"] == 0 and one["weights"] > 14 << 30  # ~15 GiB of bf16 weights
    assert eight["weights"] == one["weights"] // 8
    assert eight["optimizer"] == one["optimizer"] // 8
    # two layers (~0.4 GB each) and the embeddings and lm_head (~1 GB each) whole
    assert 2 << 30 < eight["gathered"] < 3 << 30
    assert eight["activations"] == one["activations"]  # each process runs its own rows
    assert eight["total"] < one["total"] / 2
