"""The memory estimate of a device when FSDP shards the model over N processes, and the
checkpointing plan that fits the estimate into the GPU's memory."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer.config import RunConfig
from trainer.model.memory import estimate, plan_checkpointing

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip


def test_sharding_divides_the_weights_and_lora_state_and_adds_what_is_gathered() -> None:
    kw = {"r": 16, "targets": ["q_proj", "v_proj"], "quantization": "none", "compute_bytes": 2,
          "micro_batch": 1, "seq_len": 2048, "checkpointed": 32}  # fmt: skip
    one, eight = estimate(LLAMA_8B, **kw), estimate(LLAMA_8B, **kw, shards=8)  # type: ignore[arg-type]
    assert one["gathered"] == 0 and one["weights"] > 14 << 30  # ~15 GiB of bf16 weights
    assert eight["weights"] == one["weights"] // 8
    assert eight["optimizer"] == one["optimizer"] // 8
    # two layers (~0.4 GB each) and the embeddings and lm_head (~1 GB each) whole
    assert 2 << 30 < eight["gathered"] < 3 << 30
    assert eight["activations"] == one["activations"]  # each process runs its own rows
    assert eight["total"] < one["total"] / 2


def test_the_plan_recomputes_the_fewest_layers_that_fit() -> None:
    """gradient_checkpointing auto: none where everything fits (an H200 and an 8B QLoRA
    at 4 x 2,048 tokens), every layer where only that fits, and in between the fewest
    whose estimate fits the budget."""
    kw = {"r": 16, "targets": ["q_proj", "v_proj"], "quantization": "nf4", "compute_bytes": 2,
          "micro_batch": 4, "seq_len": 2048, "cuda": True}  # fmt: skip
    full, none = (estimate(LLAMA_8B, **kw, checkpointed=n)["total"] for n in (32, 0))  # type: ignore[arg-type]
    assert plan_checkpointing(LLAMA_8B, 110 << 30, **kw) == 0
    assert plan_checkpointing(LLAMA_8B, full, **kw) == 32
    assert plan_checkpointing(LLAMA_8B, full // 2, **kw) == 32  # nothing fits: all
    middle = plan_checkpointing(LLAMA_8B, (full + none) // 2, **kw)
    assert 0 < middle < 32
    assert estimate(LLAMA_8B, **kw, checkpointed=middle)["total"] <= (full + none) // 2  # type: ignore[arg-type]
    assert estimate(LLAMA_8B, **kw, checkpointed=middle - 1)["total"] > (full + none) // 2  # type: ignore[arg-type]


def test_auto_plans_against_the_gpus_free_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe's estimate asks the GPU for its free memory and recomputes the layers
    the plan names, and says so; true and false are taken as given; the CPU plans none."""
    from trainer.assembly import estimate_memory

    said: list[str] = []
    settings: Any = SimpleNamespace(world_size=1)  # as far as the estimate reads them
    cuda = torch.device("cuda", 0)

    def checkpointed(cfg: RunConfig, device: torch.device) -> int:
        memory = estimate_memory(
            cfg, settings, device, LLAMA_8B, seq_len=2048, run_dir=tmp_path, say=said.append
        )
        return memory.checkpointed

    cfg = RunConfig.model_validate({"dataset": {"path": "x.jsonl"}, "micro_batch": 4})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (140 << 30, 141 << 30))
    assert checkpointed(cfg, cuda) == 0
    assert said[0].startswith("gradient checkpointing auto: 0 of 32 layers recomputed")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 << 30, 80 << 30))
    assert 0 < checkpointed(cfg, cuda) < 32
    assert json.loads((tmp_path / "memory-estimate.json").read_text())["total"] < 24 << 30
    cfg = RunConfig.model_validate(
        {"dataset": {"path": "x.jsonl"}, "gradient_checkpointing": False}
    )
    assert checkpointed(cfg, cuda) == 0
    cfg = RunConfig.model_validate({"dataset": {"path": "x.jsonl"}})
    assert checkpointed(cfg, torch.device("cpu")) == 0
