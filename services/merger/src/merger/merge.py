"""Merge an adapter into its base, verify the result, and publish it: the merger's I/O.

    merge_adapter(settings, "run1/adapter:3", dtype="bfloat16", device="auto") -> MergeResult

Steps: resolve the adapter and the base and dataset its manifest names; refuse a base
whose digest changed or that is quantized, and an adapter the merger cannot merge
exactly (lora.py); the preflight (preflight.py: disk, host and GPU memory, before any
work); load base + adapter once, in float32 on the merge's device, and record the
reference (logits over every probe position, greedy tokens); merge shard by shard
(shards.py) into the output dtype (default: the base's) with the tokenizer, chat
template, a generation config that stops at the end-of-turn token and a model card;
cast the loaded model to the output dtype (the dtype's own error), read the written
shards back into its base layers and compare, adapter disabled (verify.py); publish it
as a `merged-model` with merge-report.json only if it passed, the shards handed over
to the store (on a file:// store on this disk, hard-linked in as its blobs, not copied).

It owns the order of the steps and publishing; what it reads is inputs.py, what it
checks on is probing.py, the rules live in checks.py, lora.py, verify.py and card.py,
and the report's fields in report.py.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError
from lorastack.manifest import Manifest, validate_name
from lorastack.parity import REFERENCE_FILE
from lorastack.store import ArtifactStore, open_store
from merger.card import render_card
from merger.inputs import Inputs, lineage_of, read_json, resolve_inputs
from merger.loading import cast_parameters, load_merged, load_with_adapter
from merger.lora import LoraPlan, plan_lora
from merger.preflight import (
    Have,
    Need,
    Sizes,
    check_fit,
    measure,
    need_for,
    one_file_system,
    same_disk,
)
from merger.probing import (
    ModelRun,
    Probing,
    adapter_effect,
    compare,
    prepare_probes,
    run_probes,
)
from merger.report import Checked, build_report
from merger.settings import MergerSettings
from merger.shards import (
    ShardReader,
    base_dtype,
    base_layout,
    load_adapter,
    merge_shards,
    output_bytes,
    pick_device,
    read_shard,
)
from merger.verify import DTYPES, judge

log = logging.getLogger(__name__)


@dataclass
class MergeResult:
    """What merge_adapter returns: the published manifest (if verified), the report, the folder."""

    manifest: Manifest | None  # the published merged model; None when verification failed
    report: dict[str, Any]  # what merge-report.json holds
    folder: Path  # the local merged folder (kept either way, for inspection; read-only
    # once published to a file:// store on this disk: its shards are the store's blobs)
    reused: bool = False  # an earlier merge of this adapter with these settings was returned


def default_name(adapter_name: str) -> str:
    """'run1/adapter' -> 'run1/merged'; any other name gets '/merged' appended."""
    return adapter_name.removesuffix("/adapter") + "/merged"


def write_folder(inputs: Inputs, probing: Probing, dtype: str, folder: Path) -> None:
    """Everything a merged folder holds besides its shards: config in the output dtype,
    tokenizer and chat template, a generation config that stops at the end of a turn."""
    config = read_json(inputs.base_dir / "config.json")
    config = {k: v for k, v in config.items() if k != "torch_dtype"} | {"dtype": dtype}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    probing.tokenizer.save_pretrained(folder)  # tokenizer files and chat_template.jinja
    gen_path = inputs.base_dir / "generation_config.json"
    gen_cfg = read_json(gen_path) if gen_path.is_file() else {}
    gen_cfg = {k: v for k, v in gen_cfg.items() if k != "transformers_version"}
    gen_cfg |= {"eos_token_id": probing.stops, "pad_token_id": probing.pad}
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    # what the adapter answered as trained (lorastack.parity): the merged model carries it so
    # that the deployment that serves it checks it against the model that was trained
    reference = inputs.adapter_dir / REFERENCE_FILE
    if reference.is_file():
        shutil.copyfile(reference, folder / REFERENCE_FILE)


def merge_adapter(
    settings: MergerSettings,
    adapter_ref: str,
    dtype: str | None = None,
    name: str | None = None,
    probes: int = 8,
    device: str | None = None,
    resources: Callable[[Need, str], Have] = measure,
    reader: ShardReader = read_shard,
) -> MergeResult:
    """Merge, verify and (only if verified) publish. See the module docstring.
    `dtype` None: the base's own; `device` None: settings.merge_device (auto: the GPU
    when there is one). `resources` and `reader` are the seams tests fake."""
    import torch

    check_arguments(dtype, probes)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    dev = pick_device(device or settings.merge_device)
    clock = _Clock()
    inputs = resolve_inputs(settings, adapter_ref)
    layout = base_layout(inputs.base_dir)
    dtype = dtype or base_dtype(layout)
    out_name = validate_name(name or default_name(inputs.adapter.name))
    config = {"dtype": dtype, "probes": probes, "new_tokens": settings.merge_probe_new_tokens}
    store = open_store(settings)
    earlier = already_merged(store.ls(out_name), out_name, inputs.adapter, config)
    if earlier is not None:
        return _reuse(store, earlier)

    lora_config, adapter_tensors = load_adapter(inputs.adapter_dir)
    plan = _plan_lora(inputs, layout, lora_config, adapter_tensors)
    folder = settings.resolved_merge_dir / out_name / f"{inputs.adapter.version}-{dtype}"
    _preflight(settings, layout, dtype, inputs.adapter_dir, folder, dev, resources)
    probing = prepare_probes(settings, inputs, probes)
    clock.lap("fetch_and_preflight")

    model = load_with_adapter(inputs.base_dir, inputs.adapter_dir, dev)
    ref = run_probes(model, probing.encoded, probing.generation)
    effect = adapter_effect(model, probing.encoded, ref)
    clock.lap("reference")

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    stats = merge_shards(inputs.base_dir, adapter_tensors, folder, plan, dtype, dev, reader)
    del adapter_tensors
    write_folder(inputs, probing, dtype, folder)
    clock.lap("merge_and_save")

    same_dtype, got = _probe_merged(model, folder, dtype, probing)
    del model
    checked = check_merged(dtype, ref, got, same_dtype)
    clock.lap("verify")

    lineage = lineage_of(inputs.adapter, inputs.base, inputs.dataset)
    report = build_report(
        inputs=inputs,
        lineage=lineage,
        out_name=out_name,
        dtype=dtype,
        device=str(dev),
        probing=probing,
        new_tokens=settings.merge_probe_new_tokens,
        effect=effect,
        ref=ref,
        got=got,
        checked=checked,
        stats=stats,
        timings_s=clock.laps,
    ).to_json()
    (folder / "merge-report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "README.md").write_text(render_card(out_name, lineage, report))
    if not checked.verdict.passed:
        failures = "; ".join(checked.verdict.failures)
        log.warning("verification failed, nothing published: %s", failures)
        return MergeResult(manifest=None, report=report, folder=folder)
    published = _publish(store, folder, out_name, inputs, config, report, lineage)
    return MergeResult(manifest=published, report=report, folder=folder)


def check_arguments(dtype: str | None, probes: int) -> None:
    """Refuse an unknown output dtype or fewer than one probe, before any work."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if probes < 1:
        raise ConfigError(f"--probes {probes} must be at least 1", "use e.g. --probes 8")


def _reuse(store: ArtifactStore, earlier: Manifest) -> MergeResult:
    """The earlier merge as it was published, with the report it wrote."""
    kept = store.fetch(earlier)
    record = json.loads((kept / "merge-report.json").read_text())
    return MergeResult(manifest=earlier, report=record, folder=kept, reused=True)


def _plan_lora(
    inputs: Inputs, layout: dict[str, dict[str, Any]], lora_config: Any, adapter: dict[str, Any]
) -> LoraPlan:
    """Where each adapter tensor goes in the base (lora.py's checks), from headers only."""
    base_cfg = read_json(inputs.base_dir / "config.json")
    names = {n for h in layout.values() for n in h if n != "__metadata__"}
    return plan_lora(
        lora_config,
        {k: tuple(v.shape) for k, v in adapter.items()},
        names,
        tie_word_embeddings=bool(base_cfg.get("tie_word_embeddings")),
    )


def _preflight(
    settings: MergerSettings,
    layout: dict[str, dict[str, Any]],
    dtype: str,
    adapter_dir: Path,
    folder: Path,
    dev: Any,
    resources: Callable[[Need, str], Have],
) -> None:
    """Refuse, before any work, a merge that does not fit the disks, host or GPU memory
    (preflight.py); a file:// store on the output's file system costs no second copy."""
    url = settings.resolved_store_url
    sizes = sizes_of(layout, dtype, adapter_dir)
    store_dir = (
        Path(url.removeprefix("file://")).expanduser() if url.startswith("file://") else None
    )
    linked = store_dir is not None and one_file_system(folder, store_dir)
    need = same_disk(need_for(sizes, folder, store_dir, dev.type == "cuda", linked))
    check_fit(need, resources(need, str(dev)), dtype, dev.type == "cuda")


def _probe_merged(
    model: Any, folder: Path, dtype: str, probing: Probing
) -> tuple[ModelRun | None, ModelRun]:
    """The probes on base + adapter unmerged in the output dtype (None for float32), then
    on the files as they will ship: the written shards, read back into the model."""
    same_dtype = None
    if dtype != "float32":
        cast_parameters(model, dtype)  # base + adapter unmerged, in the output dtype
        same_dtype = run_probes(model, probing.encoded, probing.generation)
    load_merged(model, folder)
    with model.disable_adapter():
        got = run_probes(model, probing.encoded, probing.generation)
    return same_dtype, got


def check_merged(dtype: str, ref: ModelRun, got: ModelRun, same_dtype: ModelRun | None) -> Checked:
    """The merged model against the reference, and (for a cast) the cast and the merge
    apart; the verdict on them (verify.py)."""
    merged = compare(ref, got)
    dtype_only = merge_only = None
    if same_dtype is not None:
        dtype_only = compare(ref, same_dtype)
        merge_only = compare(same_dtype, got)
    return Checked(merged, dtype_only, merge_only, judge(dtype, merged, dtype_only))


def _publish(
    store: ArtifactStore,
    folder: Path,
    out_name: str,
    inputs: Inputs,
    config: dict[str, Any],
    report: dict[str, Any],
    lineage: dict[str, Any],
) -> Manifest:
    published = store.publish(
        folder,
        kind="merged-model",
        name=out_name,
        service="merger",
        parents=[inputs.base.as_parent("base"), inputs.adapter.as_parent("adapter")],
        config=config,
        hand_over=True,  # a file:// store on this disk links the shards in: no 16 GB copy
        metadata={
            "verification": {
                k: report["merged"][k]
                for k in ("max_abs_logit_diff", "top1_agreement", "greedy_identical")
            }
            | {"passed": True},
            "lineage": lineage,
        }
        | chat_format(inputs.adapter),
    )
    log.info("published %s (%s)", published.ref, published.digest[:19])
    return published


def sizes_of(layout: dict[str, dict[str, Any]], dtype: str, adapter_dir: Path) -> Sizes:
    """What the preflight weighs, from the base's headers and the adapter's file."""
    shard_bytes = [
        sum(
            i["data_offsets"][1] - i["data_offsets"][0] for n, i in h.items() if n != "__metadata__"
        )
        for h in layout.values()
    ]
    params = 0
    for h in layout.values():
        for n, i in h.items():
            if n != "__metadata__":
                params += math.prod(i["shape"])
    return Sizes(
        output=output_bytes(layout, dtype),
        largest_shard=max(shard_bytes),
        adapter=(adapter_dir / "adapter_model.safetensors").stat().st_size,
        params=params,
    )


def chat_format(adapter: Manifest) -> dict[str, Any]:
    """The adapter's record of its chat template and tool parser (trainer.data.chat_templates),
    for the merged model, whose folder carries the adapter's tokenizer and template: the
    inference service reads it to turn vLLM's tool parser on."""
    record = adapter.metadata.get("chat_format")
    return {"chat_format": record} if record else {}


def already_merged(
    published: list[Manifest], name: str, adapter: Manifest, config: dict[str, Any]
) -> Manifest | None:
    """The newest merged model `name` made from this very adapter (digest) with the same
    settings: merging again would only repeat minutes of work and publish a new version
    whose files differ by the report's timings."""
    for m in reversed(published):  # ArtifactStore.ls: oldest version first
        made_from = any(p.role == "adapter" and p.digest == adapter.digest for p in m.parents)
        if m.name == name and m.kind == "merged-model" and made_from and m.config == config:
            return m
    return None


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}  # seconds per step
        self._t = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(now - self._t, 2)
        self._t = now
