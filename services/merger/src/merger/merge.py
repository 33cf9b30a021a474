"""Merge an adapter into its base, verify the result, and publish it: the merger's I/O.

    merge_adapter(settings, "run1/adapter:3", dtype="bfloat16") -> MergeResult

Steps: resolve the adapter and the base and dataset its manifest names; refuse a base
whose digest changed or that is quantized; load base (float32) + adapter and record the
reference (logits over every probe position, greedy tokens); merge_and_unload in float32,
cast to the output dtype, save safetensors (sharded above `merge_max_shard_size`) with
the tokenizer, chat template, a generation config that stops at the end-of-turn token
and a model card; reload the saved folder and compare it with the reference (see
verify.py); publish it as a `merged-model` with merge-report.json only if it passed.

It owns torch, transformers, peft and the store; the rules live in checks.py, verify.py
and card.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.chat_data import load_jsonl
from lorastack.errors import ConfigError, NotFound, Refused
from lorastack.manifest import Manifest, Parent, validate_name
from lorastack.store import open_store
from merger.card import render_card, stop_token_ids
from merger.checks import check_base_digest, refuse_quantized_base
from merger.settings import MergerSettings
from merger.verify import DTYPES, THRESHOLDS, Comparison, Probe, judge, pick_probes

log = logging.getLogger(__name__)

PROBE_MAX_TOKENS = 2048  # tokens per probe conversation; longer ones are skipped (reported)
TOKENIZER_FILES = ("tokenizer_config.json",)  # an artifact that has it carries a tokenizer


@dataclass
class MergeResult:
    manifest: Manifest | None  # the published merged model; None when verification failed
    report: dict[str, Any]  # what merge-report.json holds
    folder: Path  # the local merged folder (kept either way, for inspection)
    reused: bool = False  # an earlier merge of this adapter with these settings was returned


@dataclass
class _Run:
    """What one model produced on the probes."""

    logits: list[Any]  # per probe: [positions, vocab] float32 tensor
    tokens: list[list[int]]  # per probe: greedily generated token ids


def default_name(adapter_name: str) -> str:
    """'run1/adapter' -> 'run1/merged'; any other name gets '/merged' appended."""
    return adapter_name.removesuffix("/adapter") + "/merged"


def _parent(m: Manifest, role: str) -> Parent:
    for p in m.parents:
        if p.role == role:
            return p
    raise ConfigError(
        f"{m.ref} names no {role!r} parent in its manifest",
        "merge an adapter published by the trainer (it records its base and dataset)",
    )


def _json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path.name}: {e}", "republish the artifact") from e
    return data


def safetensors_dtypes(folder: Path) -> dict[str, str]:
    """Tensor name -> dtype from every *.safetensors header in `folder` (no tensor data)."""
    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))  # header length, bytes
            header = json.loads(fh.read(n))
        out |= {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return out


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _load_probes(dataset_dir: Path, n: int) -> tuple[list[Probe], str]:
    for split in ("validation.jsonl", "train.jsonl"):
        path = dataset_dir / split
        if path.is_file() and path.stat().st_size:
            return pick_probes(load_jsonl(path), n), split
    raise Refused(
        "the adapter's dataset has neither validation.jsonl nor train.jsonl to take probes from",
        "merge an adapter whose dataset artifact holds its validation split",
    )


def _encode(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def _run_probes(model: Any, encoded: list[tuple[list[int], list[int]]], gen: Any) -> _Run:
    """Teacher-forced logits over each whole conversation; greedy tokens from its prompt."""
    import torch

    logits, tokens = [], []
    with torch.inference_mode():
        for prompt, full in encoded:
            ids = torch.tensor([full])
            logits.append(model(input_ids=ids).logits[0].float())
            p = torch.tensor([prompt])
            out = model.generate(
                input_ids=p, attention_mask=torch.ones_like(p), generation_config=gen
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return _Run(logits, tokens)


def _adapter_effect(
    model: Any, encoded: list[tuple[list[int], list[int]]], ref: _Run
) -> Comparison:
    """Base alone vs base + adapter: how much the adapter moves the logits. Near zero
    means an untrained adapter (lora_B still zero), and then verification proves little."""
    import torch

    c = Comparison()
    with torch.inference_mode(), model.disable_adapter():
        for (_, full), ref_logits in zip(encoded, ref.logits, strict=True):
            c.add_logits(ref_logits, model(input_ids=torch.tensor([full])).logits[0])
    return c


def _compare(ref: _Run, other: _Run) -> Comparison:
    c = Comparison()
    for rl, ol, rt, ot in zip(ref.logits, other.logits, ref.tokens, other.tokens, strict=True):
        c.add_logits(rl, ol)
        c.add_generation(rt, ot)
    return c


def _load_with_adapter(base_dir: Path, adapter_dir: Path) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    try:
        model = PeftModel.from_pretrained(base, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(
            f"the adapter does not load onto its base: {str(e).splitlines()[0][:300]}",
            "the adapter was trained on another architecture or vocabulary; check its base "
            "parent with 'lorastack store show'",
        ) from e
    return model.eval()


def _lineage(adapter: Manifest, base: Manifest, dataset: Parent) -> dict[str, Any]:
    run_cfg = json.dumps(adapter.config, sort_keys=True, separators=(",", ":")).encode()
    run_manifest = next((f.sha256 for f in adapter.files if f.path == "run-manifest.json"), None)
    lineage: dict[str, Any] = {
        "base": {"ref": base.ref, "digest": base.digest},
        "adapter": {"ref": adapter.ref, "digest": adapter.digest},
        "run_config_digest": "sha256:" + hashlib.sha256(run_cfg).hexdigest(),
        "run_manifest_sha256": run_manifest,
        "dataset": {"ref": f"{dataset.name}:{dataset.version}", "digest": dataset.digest},
    }
    return lineage


@dataclass
class _Inputs:
    """Everything the merge reads, resolved and fetched (verified, read-only folders)."""

    adapter: Manifest
    base: Manifest
    dataset: Parent
    adapter_dir: Path
    base_dir: Path
    dataset_dir: Path


def resolve_inputs(settings: MergerSettings, adapter_ref: str) -> _Inputs:
    """Fetch the adapter, its base and its dataset; refuse a changed or quantized base."""
    store = open_store(settings)
    adapter = store.resolve(adapter_ref)
    if adapter.kind != "adapter":
        raise ConfigError(
            f"{adapter.ref} is a {adapter.kind}, not an adapter",
            "give the adapter the trainer published, e.g. RUN/adapter",
        )
    base_parent = _parent(adapter, "base")
    try:
        base = store.manifest(base_parent.name, base_parent.version)
    except NotFound as e:
        raise Refused(
            f"the adapter's base {base_parent.name}:{base_parent.version} "
            f"({base_parent.digest}) is not in {store.url}",
            "publish that base model again (lorastack model import ...) before merging",
        ) from e
    check_base_digest(base_parent, base)
    base_dir = store.fetch(base)
    refuse_quantized_base(base.ref, _json(base_dir / "config.json"), safetensors_dtypes(base_dir))
    dataset = _parent(adapter, "dataset")
    return _Inputs(
        adapter=adapter,
        base=base,
        dataset=dataset,
        adapter_dir=store.fetch(adapter),
        base_dir=base_dir,
        dataset_dir=store.fetch(store.manifest(dataset.name, dataset.version)),
    )


@dataclass
class _Probing:
    """The tokenizer and the tokenised probes every model is run on."""

    tokenizer: Any
    stops: list[int]  # token ids that end a reply
    pad: int
    generation: Any  # transformers.GenerationConfig, greedy
    encoded: list[tuple[list[int], list[int]]]  # per probe: (prompt ids, whole conversation ids)
    source: str  # the split the probes came from
    skipped: list[int]  # probe indices longer than PROBE_MAX_TOKENS


def prepare_probes(settings: MergerSettings, inputs: _Inputs, n: int) -> _Probing:
    from transformers import AutoTokenizer, GenerationConfig

    probes, source = _load_probes(inputs.dataset_dir, n)
    has_tok = (inputs.adapter_dir / TOKENIZER_FILES[0]).is_file()
    tok = AutoTokenizer.from_pretrained(inputs.adapter_dir if has_tok else inputs.base_dir)
    template = tok.chat_template or ""
    if not template:
        raise Refused(
            f"neither the adapter nor the base {inputs.base.ref} carries a chat template",
            "publish the base with its tokenizer's chat template (the trainer needs it too)",
        )
    gen_path = inputs.base_dir / "generation_config.json"
    base_gen = _json(gen_path) if gen_path.is_file() else {}
    stops = stop_token_ids(
        tok.eos_token_id, base_gen.get("eos_token_id"), template, tok.get_vocab()
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    gen = GenerationConfig(
        max_new_tokens=settings.merge_probe_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=pad,
    )
    encoded, skipped = [], []
    for p in probes:
        full = _encode(tok, p.full, generation_prompt=False)
        if len(full) > PROBE_MAX_TOKENS:
            skipped.append(p.index)
            continue
        encoded.append((_encode(tok, p.prompt, generation_prompt=True), full))
    if not encoded:
        raise Refused(
            f"every probe conversation in {source} is longer than {PROBE_MAX_TOKENS} tokens",
            "add shorter conversations to the validation split",
        )
    return _Probing(tok, stops, pad, gen, encoded, source, skipped)


def write_merged(
    settings: MergerSettings,
    model: Any,
    inputs: _Inputs,
    probing: _Probing,
    dtype: str,
    folder: Path,
) -> None:
    """merge_and_unload in float32, cast, and save a complete HF folder into `folder`."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    merged = model.merge_and_unload()  # float32: W + scale * B @ A, exact to fp32 rounding
    merged = merged.to(_torch_dtype(dtype))
    merged.config.dtype = dtype
    merged.save_pretrained(folder, max_shard_size=settings.merge_max_shard_size)
    probing.tokenizer.save_pretrained(folder)  # tokenizer files and chat_template.jinja
    gen_path = inputs.base_dir / "generation_config.json"
    gen_cfg = _json(gen_path) if gen_path.is_file() else {}
    gen_cfg = {k: v for k, v in gen_cfg.items() if k != "transformers_version"}
    gen_cfg |= {"eos_token_id": probing.stops, "pad_token_id": probing.pad}
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


def merge_adapter(
    settings: MergerSettings,
    adapter_ref: str,
    dtype: str = "float32",
    name: str | None = None,
    probes: int = 8,
) -> MergeResult:
    """Merge, verify and (only if verified) publish. See the module docstring."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if probes < 1:
        raise ConfigError(f"--probes {probes} must be at least 1", "use e.g. --probes 8")
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    clock = _Clock()
    inputs = resolve_inputs(settings, adapter_ref)
    out_name = validate_name(name or default_name(inputs.adapter.name))
    config = {
        "dtype": dtype,
        "probes": probes,
        "new_tokens": settings.merge_probe_new_tokens,
        "max_shard_size": settings.merge_max_shard_size,
    }
    store = open_store(settings)
    earlier = already_merged(store.ls(out_name), out_name, inputs.adapter, config)
    if earlier is not None:
        kept = store.fetch(earlier)
        record = json.loads((kept / "merge-report.json").read_text())
        return MergeResult(manifest=earlier, report=record, folder=kept, reused=True)
    probing = prepare_probes(settings, inputs, probes)
    clock.lap("fetch")

    model = _load_with_adapter(inputs.base_dir, inputs.adapter_dir)
    ref = _run_probes(model, probing.encoded, probing.generation)
    effect = _adapter_effect(model, probing.encoded, ref)
    clock.lap("reference")

    folder = settings.resolved_merge_dir / out_name / f"{inputs.adapter.version}-{dtype}"
    write_merged(settings, model, inputs, probing, dtype, folder)
    del model
    clock.lap("merge_and_save")

    # Verify the files as they will ship: reload the saved folder in the output dtype.
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=_torch_dtype(dtype)).eval()
    got = _run_probes(reloaded, probing.encoded, probing.generation)
    del reloaded
    merged_cmp = _compare(ref, got)
    dtype_only: Comparison | None = None
    merge_only: Comparison | None = None
    if dtype != "float32":
        unmerged = _load_with_adapter(inputs.base_dir, inputs.adapter_dir)
        same_dtype = _run_probes(
            unmerged.to(_torch_dtype(dtype)), probing.encoded, probing.generation
        )
        del unmerged
        dtype_only = _compare(ref, same_dtype)
        merge_only = _compare(same_dtype, got)
    verdict = judge(dtype, merged_cmp, dtype_only)
    clock.lap("verify")

    lineage = _lineage(inputs.adapter, inputs.base, inputs.dataset)
    report: dict[str, Any] = {
        "schema_version": 1,
        "adapter": lineage["adapter"],
        "base": lineage["base"],
        "dataset": lineage["dataset"],
        "output": {"name": out_name, "dtype": dtype, "stop_token_ids": probing.stops},
        "dtype": dtype,
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
        metadata={
            "verification": {
                k: report["merged"][k]
                for k in ("max_abs_logit_diff", "top1_agreement", "greedy_identical")
            }
            | {"passed": True},
            "lineage": lineage,
        },
    )
    log.info("published %s (%s)", published.ref, published.digest[:19])
    return MergeResult(manifest=published, report=report, folder=folder)


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
