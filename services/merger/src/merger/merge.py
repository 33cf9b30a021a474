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
checks on is probing.py, the rules live in checks.py, lora.py, verify.py and card.py.
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
from lorastack.store import open_store
from merger.card import render_card
from merger.inputs import Inputs, lineage_of, read_json, resolve_inputs
from merger.lora import plan_lora
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
from merger.probing import Probing, adapter_effect, compare, prepare_probes, run_probes
from merger.settings import MergerSettings
from merger.shards import (
    ShardReader,
    base_dtype,
    base_layout,
    base_shards,
    load_adapter,
    merge_shards,
    output_bytes,
    pick_device,
    read_shard,
)
from merger.verify import DTYPES, THRESHOLDS, Comparison, judge

log = logging.getLogger(__name__)


@dataclass
class MergeResult:
    manifest: Manifest | None  # the published merged model; None when verification failed
    report: dict[str, Any]  # what merge-report.json holds
    folder: Path  # the local merged folder (kept either way, for inspection; read-only
    # once published to a file:// store on this disk: its shards are the store's blobs)
    reused: bool = False  # an earlier merge of this adapter with these settings was returned


def default_name(adapter_name: str) -> str:
    """'run1/adapter' -> 'run1/merged'; any other name gets '/merged' appended."""
    return adapter_name.removesuffix("/adapter") + "/merged"


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _load_base(base_dir: Path, device: Any) -> Any:
    """The base in float32 on `device`, its weights copied in shard by shard (one shard's
    pages mapped at a time: from_pretrained mapped every shard at once, 17.9 GB of host
    RSS for an 8B), every tensor of the model loaded or tied to a loaded one."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for shard in base_shards(base_dir):
            with safe_open(str(base_dir / shard), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    if name not in state:
                        raise ConfigError(
                            f"the base's tensor {name} is not in {type(model).__name__}",
                            "publish the base as transformers saves it",
                        )
                    state[name].copy_(f.get_tensor(name))
                    loaded.add(name)
    ptrs = {state[n].data_ptr() for n in loaded}
    missing = [n for n in state if n not in loaded and state[n].data_ptr() not in ptrs]
    if missing:
        raise ConfigError(
            f"the base has no weights for {', '.join(missing[:3])}",
            "publish the complete base model",
        )
    return model


def _load_with_adapter(base_dir: Path, adapter_dir: Path, device: Any) -> Any:
    """Base + adapter in float32 on `device`, loaded once for every comparison."""
    from peft import PeftModel

    base = _load_base(base_dir, device)
    try:
        model = PeftModel.from_pretrained(base, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(
            f"the adapter does not load onto its base: {str(e).splitlines()[0][:300]}",
            "the adapter was trained on another architecture or vocabulary; check its base "
            "parent with 'lorastack store show'",
        ) from e
    return model.eval()


def _cast_parameters(model: Any, dtype: str) -> None:
    """Parameters to `dtype`, buffers (rotary frequencies) untouched: as from_pretrained
    in that dtype loads them."""
    t = _torch_dtype(dtype)
    for p in model.parameters():
        p.data = p.data.to(t)


def _load_merged(model: Any, folder: Path) -> None:
    """Copy the merged shards as written into the base layers of the loaded PeftModel:
    with its adapter disabled it is then the merged model as it ships."""
    import torch
    from safetensors import safe_open

    base = model.get_base_model()
    with torch.no_grad():
        for shard in base_shards(folder):
            with safe_open(str(folder / shard), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    module_path, _, leaf = name.rpartition(".")
                    module = base.get_submodule(module_path)
                    module = (
                        getattr(module, "base_layer", None)
                        or getattr(module, "original_module", None)
                        or module
                    )
                    getattr(module, leaf).copy_(f.get_tensor(name))


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

    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if probes < 1:
        raise ConfigError(f"--probes {probes} must be at least 1", "use e.g. --probes 8")
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
        kept = store.fetch(earlier)
        record = json.loads((kept / "merge-report.json").read_text())
        return MergeResult(manifest=earlier, report=record, folder=kept, reused=True)

    lora_config, adapter_tensors = load_adapter(inputs.adapter_dir)
    base_cfg = read_json(inputs.base_dir / "config.json")
    names = {n for h in layout.values() for n in h if n != "__metadata__"}
    plan = plan_lora(
        lora_config,
        {k: tuple(v.shape) for k, v in adapter_tensors.items()},
        names,
        tie_word_embeddings=bool(base_cfg.get("tie_word_embeddings")),
    )
    folder = settings.resolved_merge_dir / out_name / f"{inputs.adapter.version}-{dtype}"
    url = settings.resolved_store_url
    sizes = sizes_of(layout, dtype, inputs.adapter_dir)
    store_dir = (
        Path(url.removeprefix("file://")).expanduser() if url.startswith("file://") else None
    )
    linked = store_dir is not None and one_file_system(folder, store_dir)
    need = same_disk(need_for(sizes, folder, store_dir, dev.type == "cuda", linked))
    check_fit(need, resources(need, str(dev)), dtype, dev.type == "cuda")
    probing = prepare_probes(settings, inputs, probes)
    clock.lap("fetch_and_preflight")

    model = _load_with_adapter(inputs.base_dir, inputs.adapter_dir, dev)
    ref = run_probes(model, probing.encoded, probing.generation)
    effect = adapter_effect(model, probing.encoded, ref)
    clock.lap("reference")

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    stats = merge_shards(inputs.base_dir, adapter_tensors, folder, plan, dtype, dev, reader)
    del adapter_tensors
    write_folder(inputs, probing, dtype, folder)
    clock.lap("merge_and_save")

    dtype_only: Comparison | None = None
    merge_only: Comparison | None = None
    same_dtype = None
    if dtype != "float32":
        _cast_parameters(model, dtype)  # base + adapter unmerged, in the output dtype
        same_dtype = run_probes(model, probing.encoded, probing.generation)
    # Verify the files as they will ship: the written shards, read back into the model.
    _load_merged(model, folder)
    with model.disable_adapter():
        got = run_probes(model, probing.encoded, probing.generation)
    del model
    merged_cmp = compare(ref, got)
    if same_dtype is not None:
        dtype_only = compare(ref, same_dtype)
        merge_only = compare(same_dtype, got)
    verdict = judge(dtype, merged_cmp, dtype_only)
    clock.lap("verify")

    lineage = lineage_of(inputs.adapter, inputs.base, inputs.dataset)
    report: dict[str, Any] = {
        "schema_version": 1,
        "adapter": lineage["adapter"],
        "base": lineage["base"],
        "dataset": lineage["dataset"],
        "output": {"name": out_name, "dtype": dtype, "stop_token_ids": probing.stops},
        "dtype": dtype,
        "device": str(dev),
        "passed": verdict.passed,
        "failures": verdict.failures,
        "advice": verdict.advice,
        "notes": _notes(inputs.adapter),
        "thresholds": THRESHOLDS[dtype].as_dict(),
        "reference": "base + adapter, unmerged, float32",
        "adapter_effect": {
            "max_abs_logit_diff": effect.max_abs,
            "top1_agreement": round(effect.top1, 6),
            "note": "base alone vs the reference; near 0 means the adapter changes nothing",
        },
        "merged": merged_cmp.summary(),
        "dtype_only": dtype_only.summary() if dtype_only else None,
        "merge_only": merge_only.summary() if merge_only else None,
        "probes": {
            "source": f"{inputs.dataset.name}:{inputs.dataset.version}/{probing.source}",
            "count": len(probing.encoded),
            "skipped_too_long": probing.skipped,
            "new_tokens": settings.merge_probe_new_tokens,
            "greedy_reference": [probing.tokenizer.decode(t) for t in ref.tokens],
            "greedy_merged": [probing.tokenizer.decode(t) for t in got.tokens],
        },
        "shards": {
            "files": stats.shards,
            "tensors": stats.tensors,
            "merged_tensors": stats.merged,
            "bytes_written": stats.bytes_written,
        },
        "lineage": lineage,
        "timings_s": clock.laps,
    }
    (folder / "merge-report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "README.md").write_text(render_card(out_name, lineage, report))
    if not verdict.passed:
        log.warning("verification failed, nothing published: %s", "; ".join(verdict.failures))
        return MergeResult(manifest=None, report=report, folder=folder)
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
    return MergeResult(manifest=published, report=report, folder=folder)


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


def _notes(adapter: Manifest) -> list[str]:
    if "nf4" in (adapter.config.get("quantization"), adapter.metadata.get("quantization")):
        return [
            "QLoRA adapter: it trained against an nf4 view of the base and is merged into the "
            "unquantised base, as it should be; the reference is base + adapter in float32"
        ]
    return []
