"""What a merge reads: the adapter, and the base and dataset its manifest names, resolved
in the store, checked (the base's digest unchanged, the base not quantized) and fetched as
verified read-only folders; and the lineage the merged model records.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, NotFound, Refused
from lorastack.manifest import Manifest, Parent
from lorastack.store import open_store
from merger.checks import check_base_digest, refuse_quantized_base
from merger.settings import MergerSettings


def _parent(m: Manifest, role: str) -> Parent:
    for p in m.parents:
        if p.role == role:
            return p
    raise ConfigError(
        f"{m.ref} names no {role!r} parent in its manifest",
        "merge an adapter published by the trainer (it records its base and dataset)",
    )


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of an artifact; ConfigError when it cannot be read."""
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


@dataclass
class Inputs:
    """Everything the merge reads, resolved and fetched (verified, read-only folders)."""

    adapter: Manifest
    base: Manifest
    dataset: Parent
    adapter_dir: Path
    base_dir: Path
    dataset_dir: Path


def resolve_inputs(settings: MergerSettings, adapter_ref: str) -> Inputs:
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
    refuse_quantized_base(
        base.ref, read_json(base_dir / "config.json"), safetensors_dtypes(base_dir)
    )
    dataset = _parent(adapter, "dataset")
    return Inputs(
        adapter=adapter,
        base=base,
        dataset=dataset,
        adapter_dir=store.fetch(adapter),
        base_dir=base_dir,
        dataset_dir=store.fetch(store.manifest(dataset.name, dataset.version)),
    )


def lineage_of(adapter: Manifest, base: Manifest, dataset: Parent) -> dict[str, Any]:
    """Where a merged model comes from: base, adapter, run config and dataset, by digest."""
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
