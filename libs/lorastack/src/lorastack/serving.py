"""What the vLLM that serves lorastack's artifacts accepts, shared by the merger (which checks
an adapter before it is served) and inference (which passes the flags to vLLM)."""

from __future__ import annotations

# The ranks vLLM accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks, vLLM 0.32).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_max_lora_rank(rank: int) -> int:
    """`rank` when vLLM accepts it as --max-lora-rank, else a ValueError (for a validator)."""
    if rank not in VLLM_MAX_LORA_RANKS:
        raise ValueError(f"vLLM accepts --max-lora-rank only in {VLLM_MAX_LORA_RANKS}")
    return rank
