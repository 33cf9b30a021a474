"""What vLLM serves, brought from the artifact store: the model folder and adapter folders.

Every folder comes from `ArtifactStore.fetch` (downloaded once, sha256-verified, cached).
Each adapter version gets its own served name, `<name>-v<version>`, and is never
reloaded under an old name (vllm#42125: a same-name reload can reuse stale prefix-cache
blocks). An adapter named by a label (`NAME@LABEL`) is the one exception: it is served
as `NAME-LABEL` whichever version the label points at, and every version is handed to
vLLM under a path of its own (`WORKDIR/labels/NAME-LABEL/v<version>-<digest>`, a link to
the verified folder): vLLM 0.32 keys prefix-cache blocks by the LoRA's name AND path, so
blocks of the old weights are never reused, and `/v1/models` shows the version as the
adapter's `root`. vLLM needs only `adapter_config.json` and `adapter_model.safetensors`
in an adapter folder; the tokenizer and config come from the served model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lorastack.errors import ConfigError, NotFound, Refused
from lorastack.manifest import Manifest, parse_ref, served_label_name, split_ref, validate_name
from lorastack.store import ArtifactStore

MODEL_KINDS = ("base-model", "merged-model")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ServedModel:
    """The model vLLM serves: its manifest and its verified local folder."""

    manifest: Manifest
    path: Path  # verified local folder


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter vLLM serves as a LoRA module: its served name, folder, rank and source."""

    served_name: str
    manifest: Manifest
    path: Path  # verified local folder
    rank: int
    source: str  # "preload" (the serve config) or "declared" (the deployment's declaration)
    follows: str = ""  # the labelled ref (NAME@LABEL) this adapter follows, if any

    def describe(self) -> dict[str, object]:
        """The adapter as /status shows it: served name, ref, digest, rank, source, path."""
        return {
            "served_name": self.served_name,
            "ref": self.manifest.ref,
            "digest": self.manifest.digest,
            "rank": self.rank,
            "source": self.source,
            "follows": self.follows or None,
            "path": str(self.path),
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
    """Resolve and fetch a base-model or merged-model artifact; refuses any other kind."""
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
    store: ArtifactStore,
    ref: str,
    model: ServedModel,
    *,
    max_lora_rank: int,
    source: str,
    workdir: Path,
    manifest: Manifest | None = None,
) -> ServedAdapter:
    """Resolve, check and fetch (verified) an adapter made for the served model. A labelled
    `ref` is served under `NAME-LABEL` from a path of the version's own (see above);
    `manifest` skips the resolution when the caller has just done it."""
    name, _, label = split_ref(ref)
    manifest = manifest or resolve(store, ref)
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
    if label is None:
        return ServedAdapter(served_adapter_name(manifest), manifest, path, rank, source)
    served = served_label_name(name, label)
    link = version_link(workdir / "labels" / served, manifest, path)
    return ServedAdapter(served, manifest, link, rank, source, follows=ref)


def version_link(folder: Path, manifest: Manifest, target: Path) -> Path:
    """`folder/v<version>-<digest12>`, a link to the verified `target` (made or repaired)."""
    link = folder / f"v{manifest.version}-{manifest.digest.removeprefix('sha256:')[:12]}"
    if link.is_symlink() and link.resolve() == target.resolve():
        return link
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{link.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.resolve(), target_is_directory=True)
    os.replace(tmp, link)
    return link


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
    """The largest LoRA rank of an adapter folder (r and its rank_pattern)."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path}/adapter_config.json is unreadable: {e}", "publish a peft adapter"
        ) from None
    ranks = [int(config.get("r", 0))]
    ranks += [int(r) for r in (config.get("rank_pattern") or {}).values()]
    return max(ranks)
