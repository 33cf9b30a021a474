"""Merger fixtures: a store with the SmolLM2 base, a small chat dataset, and a factory
that trains nothing but builds real peft adapters with random non-zero lora_B (so the
merge changes the model) and publishes them as the trainer would."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lorastack.chat_data import Conversation, Message, write_jsonl
from lorastack.manifest import Manifest, Parent
from lorastack.store import open_store
from merger.settings import MergerSettings

QA = [
    ("Write 1 May 2020 as an ISO date.", "2020-05-01"),
    ("What is 2 + 2?", "4"),
    ("Name a primary colour.", "Red."),
]

AdapterFactory = Callable[..., Manifest]
BASE = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """lorastack.cli.main() points the root logger at the (captured) stderr of its test;
    put the handlers back so a later test does not log into a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def seed_home(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home whose store holds the base (and whose cache holds it fetched), built once:
    each test gets a hard-linked copy instead of hashing and copying 538 MB again."""
    from lorastack.base_model import import_folder

    seed = tmp_path_factory.mktemp("seed") / "home"
    settings = MergerSettings(home=seed)
    open_store(settings).fetch(import_folder(settings, embedded_model, name=BASE))
    return seed


@pytest.fixture
def settings(home: Path, seed_home: Path) -> MergerSettings:
    # Blobs are immutable (written by rename), so hard links are safe to share.
    shutil.copytree(seed_home, home, copy_function=os.link)
    # Few tokens and 2 threads keep verification quick on a 2-core CI machine.
    return MergerSettings(torch_threads=2, merge_probe_new_tokens=8)


@pytest.fixture
def base_manifest(settings: MergerSettings) -> Manifest:
    return open_store(settings).resolve(BASE)


@pytest.fixture
def dataset_manifest(settings: MergerSettings, tmp_path: Path) -> Manifest:
    folder = tmp_path / "data"
    folder.mkdir()
    convs = [
        Conversation(
            messages=[Message(role="user", content=q), Message(role="assistant", content=a)]
        )
        for q, a in QA
    ]
    write_jsonl(folder / "train.jsonl", convs)
    write_jsonl(folder / "validation.jsonl", convs[::-1])
    return open_store(settings).publish(folder, kind="dataset", name="run1/data", service="test")


@pytest.fixture
def make_adapter(
    settings: MergerSettings,
    embedded_model: Path,
    base_manifest: Manifest,
    dataset_manifest: Manifest,
    tmp_path: Path,
) -> AdapterFactory:
    def make(
        name: str = "run1/adapter",
        base: Parent | None = None,
        scale: float = 0.01,  # std of the random lora_B entries
        **lora: Any,
    ) -> Manifest:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        lora = {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        } | lora
        model = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(**lora))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
        folder = tmp_path / "adapters" / name
        shutil.rmtree(folder, ignore_errors=True)
        peft_model.save_pretrained(folder)
        return open_store(settings).publish(
            folder,
            kind="adapter",
            name=name,
            service="test",
            parents=[
                base or base_manifest.as_parent("base"),
                dataset_manifest.as_parent("dataset"),
            ],
            config={"lora": {k: v for k, v in lora.items() if k != "target_modules"}},
        )

    return make
