"""What vLLM serves, brought from the artifact store: the model folder and adapter folders.

Every folder comes from `ArtifactStore.fetch` (downloaded once, sha256-verified, cached).
Each adapter version gets its own served name, `<name>-v<version>`, and is never
reloaded under an old name (vllm#42125: a same-name reload can reuse stale prefix-cache
blocks). vLLM needs only `adapter_config.json` and `adapter_model.safetensors` in an
adapter folder; the tokenizer and config come from the served model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorastack.errors import ConfigError, NotFound, Refused
from lorastack.manifest import Manifest, parse_ref, validate_name
from lorastack.store import ArtifactStore

MODEL_KINDS = ("base-model", "merged-model")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ServedModel:
    manifest: Manifest
    path: Path  # verified local folder


@dataclass(frozen=True)
class ServedAdapter:
    served_name: str
    manifest: Manifest
    path: Path  # verified local folder
    rank: int
    source: str  # "preload" or "runtime"

    def describe(self) -> dict[str, object]:
        return {
            "served_name": self.served_name,
            "ref": self.manifest.ref,
            "digest": self.manifest.digest,
            "rank": self.rank,
            "source": self.source,
        }


def served_adapter_name(manifest: Manifest) -> str:
    """`<name>-v<version>`: a new version is a new name, never a reload of an old one."""
    return validate_name(f"{manifest.name}-v{manifest.version}", "served adapter name")


def resolve(store: ArtifactStore, ref: str) -> Manifest:
    """The manifest of `ref`; a missing one says how to list what exists."""
    parse_ref(ref)
    try:
        return store.resolve(ref)
    except NotFound as e:
        raise NotFound(
            e.message,
            e.hint or f"list the published versions: lorastack store ls {ref.partition(':')[0]}",
        ) from None


def fetch_model(store: ArtifactStore, ref: str) -> ServedModel:
    manifest = resolve(store, ref)
    if manifest.kind not in MODEL_KINDS:
        raise ConfigError(
            f"{manifest.ref} is a {manifest.kind}, not a model",
            "serve a base-model or merged-model artifact; list adapters under 'adapters'",
        )
    path = store.fetch(manifest)
    if not (path / "config.json").is_file():
        raise NotFound(f"{manifest.ref} has no config.json", "publish a Hugging Face model folder")
    return ServedModel(manifest, path)


def fetch_adapter(
    store: ArtifactStore, ref: str, model: ServedModel, *, max_lora_rank: int, source: str
) -> ServedAdapter:
    """Resolve, check and fetch (verified) an adapter made for the served model."""
    manifest = resolve(store, ref)
    if manifest.kind != "adapter":
        raise ConfigError(
            f"{manifest.ref} is a {manifest.kind}, not an adapter",
            "give the ref of an adapter artifact (kind 'adapter'), e.g. RUN/adapter:1",
        )
    check_adapter_base(manifest, model.manifest)
    present = {f.path for f in manifest.files}
    missing = [f for f in ADAPTER_FILES if f not in present]
    if missing:
        raise NotFound(
            f"{manifest.ref} lacks {', '.join(missing)}",
            "publish the folder written by peft's save_pretrained",
        )
    path = store.fetch(manifest)
    rank = adapter_rank(path)
    if rank > max_lora_rank:
        raise Refused(
            f"{manifest.ref} has LoRA rank {rank}, above max_lora_rank {max_lora_rank}",
            f"restart the server with max_lora_rank >= {rank}",
        )
    return ServedAdapter(served_adapter_name(manifest), manifest, path, rank, source)


def check_adapter_base(adapter: Manifest, model: Manifest) -> None:
    """An adapter whose recorded base is another model is refused (its answers would be
    garbage); an adapter with no recorded base is let through."""
    bases = [p for p in adapter.parents if p.role == "base"]
    if bases and all(p.digest != model.digest for p in bases):
        b = bases[0]
        raise Refused(
            f"{adapter.ref} was trained on {b.name}:{b.version}, not on the served model "
            f"{model.ref}",
            f"serve {b.name}:{b.version} to use this adapter (a merged model already holds "
            "its adapter)",
        )


def adapter_rank(path: Path) -> int:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path}/adapter_config.json is unreadable: {e}", "publish a peft adapter"
        ) from None
    ranks = [int(config.get("r", 0))]
    ranks += [int(r) for r in (config.get("rank_pattern") or {}).values()]
    return max(ranks)
