"""The QLoRA path (nf4, double quant, fp32 compute) trains on CPU and publishes the
adapter with its metrics, plot, completion record, lineage and parity reference."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.parity import REFERENCE_FILE, read_reference_bytes
from lorastack.store import open_store
from trainer.config import load_config
from trainer.recipe import run_training
from trainer.settings import TrainerSettings


@pytest.mark.slow
def test_qlora_trains_a_few_steps_on_cpu_and_publishes_the_adapter(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    cfg = load_config(
        write_config("qlora", demo_jsonl),
        ["quantization=nf4", "max_steps=2", "price_per_gpu_hour=3.6"],
    )
    result = run_training(cfg, trainer_env)
    assert result.steps == 2 and all(math.isfinite(v) for v in result.losses.values())
    assert result.adapter is not None and result.data is not None and result.test is not None
    store = open_store(trainer_env)
    m = store.manifest("qlora/adapter")
    files = {f.path for f in m.files}
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "run-manifest.json",
        "loss.png",
        "training-complete.json",
        "metrics/metrics-step-1.json",
        "metrics/eval-step-2.json",
    ):
        assert name in files, name
    assert {p.role: p.name for p in m.parents} == {
        "base": "smollm2-135m-instruct",
        "dataset": "qlora/data",
    }
    assert m.metadata["test_split"]["digest"] == result.test.digest
    folder = store.fetch(m)
    done = json.loads((folder / "training-complete.json").read_text())
    assert done["steps"] == 2 and done["final_val_loss"] is not None
    assert done["cost"] == pytest.approx(done["billed_hours"] * 3.6, rel=1e-3)
    adapter_cfg = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"].startswith("smollm2-135m-instruct:")
    assert [v for v in store.versions("qlora/checkpoints")] == ["2"]
    # its parity reference is recorded on the unquantised base it is served on (float32 on
    # the CPU), so serving holds it to the limits of any adapter
    ref = read_reference_bytes((folder / REFERENCE_FILE).read_bytes(), "the reference")
    assert (ref.quantization, ref.trained_quantization, ref.dtype) == ("none", "nf4", "float32")
    assert m.metadata["parity_reference"]["trained_quantization"] == "nf4"
