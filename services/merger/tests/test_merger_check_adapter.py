"""`lorastack merge check-adapter`: real peft adapters judged against vLLM's LoRA limits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.cli import main
from lorastack.manifest import Manifest

AdapterFactory = Callable[..., Manifest]  # the make_adapter fixture (conftest.py)


def test_rank_above_server_max_is_flagged(
    make_adapter: AdapterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = make_adapter(r=32, lora_alpha=64)
    assert main(["merge", "check-adapter", adapter.ref, "--max-lora-rank", "16"]) == 3
    out = capsys.readouterr()
    assert "LoRA rank 32 is above the server's --max-lora-rank 16" in out.out
    assert "start vLLM with --max-lora-rank 32" in out.out
    assert "not loadable by vLLM" in out.err


def test_trained_embeddings_are_flagged(
    make_adapter: AdapterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = make_adapter(modules_to_save=["embed_tokens"])
    assert main(["merge", "check-adapter", adapter.ref]) == 3
    out = capsys.readouterr().out
    assert "trains full modules ['embed_tokens'] (modules_to_save)" in out
    assert "merge the adapter" in out


def test_loadable_adapter_is_exported(
    make_adapter: AdapterFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = make_adapter(target_modules="all-linear")
    dest = tmp_path / "serve" / "adapter-v1"
    assert main(["merge", "check-adapter", adapter.ref, "--export", str(dest)]) == 0
    assert "loadable by vLLM" in capsys.readouterr().out
    assert sorted(p.name for p in dest.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "vllm-check.json",
    ]
    check = json.loads((dest / "vllm-check.json").read_text())
    assert check["loadable"] and check["architecture"] == "LlamaForCausalLM"


def test_bad_arguments_say_what_to_change(
    make_adapter: AdapterFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main(["merge", "check-adapter"]) == 2
    assert "check-adapter needs an adapter" in capsys.readouterr().err
    assert main(["merge", "run1/adapter", "--max-lora-rank", "16"]) == 2
    assert "belong to check-adapter" in capsys.readouterr().err
    assert main(["merge", "nothing/here"]) == 2
    assert "no artifact named 'nothing/here'" in capsys.readouterr().err
    monkeypatch.setenv("LORASTACK_MAX_LORA_RANK", "12")
    assert main(["merge", "check-adapter", "run1/adapter"]) == 2
    err = capsys.readouterr().err
    assert "max_lora_rank: vLLM accepts --max-lora-rank only in" in err
    assert "LORASTACK_MAX_LORA_RANK" in err
