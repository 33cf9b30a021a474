"""merge-report.json: what a merge wrote down about itself, as typed records.

    MergeReport(...).to_json() -> the dict merge-report.json holds (its keys in this order)

Owns: the report's fields, their order and how each is built from the merge's results
(pure: no I/O). Does not own: the comparisons and verdict (verify.py), the model card
that quotes it (card.py), writing it (merge.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from merger.inputs import Inputs
from merger.probing import ModelRun, Probing
from merger.shards import ShardStats
from merger.verify import THRESHOLDS, Comparison, Verdict

SCHEMA_VERSION = 1
REFERENCE = "base + adapter, unmerged, float32"
EFFECT_NOTE = "base alone vs the reference; near 0 means the adapter changes nothing"


@dataclass(frozen=True)
class Output:
    """The merged model as published: name, dtype and stop tokens."""

    name: str  # the merged model's name in the store
    dtype: str
    stop_token_ids: list[int]  # the generation config's end-of-turn tokens


@dataclass(frozen=True)
class AdapterEffect:
    """How far the adapter moves the base (base vs base + adapter), for scale."""

    max_abs_logit_diff: float
    top1_agreement: float  # rounded to 6 places
    note: str = EFFECT_NOTE


@dataclass(frozen=True)
class Probes:
    """What verification ran on: the probe source, count and greedy outputs."""

    source: str  # "<dataset>:<version>/<split>"
    count: int
    skipped_too_long: list[int]  # probe indices longer than PROBE_MAX_TOKENS
    new_tokens: int  # greedy tokens generated per probe
    greedy_reference: list[str]
    greedy_merged: list[str]


@dataclass(frozen=True)
class Shards:
    """What the shard-by-shard merge wrote."""

    files: int
    tensors: int
    merged_tensors: int  # tensors that took a LoRA delta or a copy
    bytes_written: int


@dataclass(frozen=True, kw_only=True)
class MergeReport:
    """One merge's record. Field order is the JSON's key order; the comparisons are
    `Comparison.summary()` dicts, `None` where the output dtype is float32."""

    schema_version: int = SCHEMA_VERSION
    adapter: dict[str, Any]  # lineage: ref and digest
    base: dict[str, Any]
    dataset: dict[str, Any]
    output: Output
    dtype: str
    device: str
    passed: bool
    failures: list[str]
    advice: list[str]
    notes: list[str]
    thresholds: dict[str, Any]
    reference: str = REFERENCE
    adapter_effect: AdapterEffect
    merged: dict[str, Any]  # merged vs the reference
    dtype_only: dict[str, Any] | None  # the cast alone: unmerged in dtype vs the reference
    merge_only: dict[str, Any] | None  # the merge alone: merged vs unmerged in dtype
    probes: Probes
    shards: Shards
    lineage: dict[str, Any]
    timings_s: dict[str, float] = field(default_factory=dict)  # seconds per step

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class Checked:
    """The comparisons verification made, and its verdict."""

    merged: Comparison  # merged vs the reference
    dtype_only: Comparison | None
    merge_only: Comparison | None
    verdict: Verdict


def build_report(
    *,
    inputs: Inputs,
    lineage: dict[str, Any],
    out_name: str,
    dtype: str,
    device: str,
    probing: Probing,
    new_tokens: int,
    effect: Comparison,
    ref: ModelRun,
    got: ModelRun,
    checked: Checked,
    stats: ShardStats,
    timings_s: dict[str, float],
) -> MergeReport:
    """merge-report.json's content, from the merge's inputs, comparisons and verdict."""
    decode = probing.tokenizer.decode
    return MergeReport(
        adapter=lineage["adapter"],
        base=lineage["base"],
        dataset=lineage["dataset"],
        output=Output(out_name, dtype, probing.stops),
        dtype=dtype,
        device=device,
        passed=checked.verdict.passed,
        failures=checked.verdict.failures,
        advice=checked.verdict.advice,
        notes=notes(inputs),
        thresholds=THRESHOLDS[dtype].as_dict(),
        adapter_effect=AdapterEffect(effect.max_abs, round(effect.top1, 6)),
        merged=checked.merged.summary(),
        dtype_only=checked.dtype_only.summary() if checked.dtype_only else None,
        merge_only=checked.merge_only.summary() if checked.merge_only else None,
        probes=Probes(
            source=f"{inputs.dataset.name}:{inputs.dataset.version}/{probing.source}",
            count=len(probing.encoded),
            skipped_too_long=probing.skipped,
            new_tokens=new_tokens,
            greedy_reference=[decode(t) for t in ref.tokens],
            greedy_merged=[decode(t) for t in got.tokens],
        ),
        shards=Shards(stats.shards, stats.tensors, stats.merged, stats.bytes_written),
        lineage=lineage,
        timings_s=timings_s,
    )


def notes(inputs: Inputs) -> list[str]:
    """Notes the report carries about its inputs (a QLoRA adapter merged unquantised)."""
    adapter = inputs.adapter
    if "nf4" in (adapter.config.get("quantization"), adapter.metadata.get("quantization")):
        return [
            "QLoRA adapter: it trained against an nf4 view of the base and is merged into the "
            "unquantised base, as it should be; the reference is base + adapter in float32"
        ]
    return []
