"""Trainer test fixtures: one store holding the embedded SmolLM2 (published once per
session), a per-test runs folder, a small demo dataset and run-config writer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorastack.chat_data import write_jsonl
from trainer.data.demo_data import make_demo
from trainer.settings import TrainerSettings

BASE = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def store_home(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Path:
    from lorastack.base_model import import_folder

    home = tmp_path_factory.mktemp("trainer-home")
    import_folder(TrainerSettings(home=home, store_url=""), embedded_model, name=BASE)
    return home


@pytest.fixture
def trainer_env(
    store_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> TrainerSettings:
    """Environment (for subprocesses) and settings (for in-process calls) of one test."""
    env = {
        "LORASTACK_HOME": str(store_home),
        "LORASTACK_RUNS_DIR": str(tmp_path / "runs"),
        "LORASTACK_TORCH_THREADS": "1",  # fixed (bitwise equality); 1 survives a busy machine
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LORASTACK_STORE_URL", raising=False)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    return TrainerSettings()


@pytest.fixture
def demo_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "dates.jsonl"
    write_jsonl(path, make_demo(30, seed=1))
    return path


SMALL = {
    "base_model": BASE,
    "split": {"validation": 0.1, "test": 0.1, "seed": 0},
    "lora": {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
    "max_seq_len": 128,
    "micro_batch": 2,
    "grad_accum": 1,
    "lr": 1e-3,
    "schedule": "cosine",
    "warmup_steps": 1,
    "max_steps": 6,
    "checkpoint_every": 2,
    "eval_every": 3,
    "keep_checkpoints": 2,
    "seed": 0,
}


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    def write(name: str, dataset: Path, **fields: Any) -> Path:
        data = {**SMALL, "output": name, "dataset": {"path": str(dataset)}, **fields}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return write


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocabulary 96) saved as an HF folder: model-level tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu need a CUDA device: skipped where torch sees none (CI)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
