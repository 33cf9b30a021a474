"""Adapter-only export for vLLM multi-LoRA serving: check an adapter artifact against the
server's limits and, if it passes, copy the files vLLM reads into a serving folder.

Owns the I/O around `checks.check_adapter_for_vllm`: fetching the adapter, reading its
config and safetensors header, and reading the base's config.json (one file, verified)
for the architecture and vocabulary size.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, IntegrityError, NotFound, Refused
from lorastack.manifest import Manifest, sha256_file
from lorastack.store import ArtifactStore, open_store
from merger.checks import Finding, check_adapter_for_vllm
from merger.inputs import safetensors_dtypes
from merger.settings import MergerSettings

SERVING_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what vLLM reads


@dataclass
class AdapterCheck:
    """Whether vLLM can serve an adapter artifact unmerged: the findings of check_adapter."""

    adapter: Manifest
    architecture: str
    max_lora_rank: int
    findings: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def as_dict(self) -> dict[str, Any]:
        """The check as a JSON-ready dict: the adapter, whether it loads, the findings."""
        return {
            "adapter": {"ref": self.adapter.ref, "digest": self.adapter.digest},
            "architecture": self.architecture,
            "max_lora_rank": self.max_lora_rank,
            "loadable": not self.errors,
            "findings": [f.__dict__ for f in self.findings],
        }


def _read_file(store: ArtifactStore, m: Manifest, path: str) -> bytes:
    """One file of an artifact, verified against its sha256, without fetching the rest."""
    entry = next((f for f in m.files if f.path == path), None)
    if entry is None:
        raise NotFound(
            f"{m.ref} has no file {path}", "check the artifact with lorastack store show"
        )
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "blob"
        store.backend.download_blob(entry.sha256, dest)
        if sha256_file(dest) != entry.sha256:
            raise IntegrityError(f"{m.ref}: {path} is corrupted in {store.url}", "republish it")
        return dest.read_bytes()


def check_adapter(
    settings: MergerSettings, ref: str, max_lora_rank: int | None = None
) -> AdapterCheck:
    """Check an adapter artifact against its base and vLLM's LoRA limits (`max_lora_rank`)."""
    store = open_store(settings)
    adapter = store.resolve(ref)
    if adapter.kind != "adapter":
        raise ConfigError(
            f"{ref} is a {adapter.kind}, not an adapter", "give RUN/adapter[:VERSION]"
        )
    folder = store.fetch(adapter)
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(
            f"{adapter.ref} has no adapter_config.json", "publish a peft adapter folder"
        )
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = safetensors_dtypes(folder)
    base_cfg: dict[str, Any] = {}
    base = next((p for p in adapter.parents if p.role == "base"), None)
    if base is not None:
        try:
            base_m = store.manifest(base.name, base.version)
            base_cfg = json.loads(_read_file(store, base_m, "config.json"))
        except NotFound:
            base_cfg = {}  # judged from the adapter alone; the architecture comes from peft
    arch = (base_cfg.get("architectures") or [None])[0] or (
        (config.get("auto_mapping") or {}).get("base_model_class") or "unknown"
    )
    adapter_vocab = None
    if (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        adapter_vocab = len(AutoTokenizer.from_pretrained(folder))
    rank = max_lora_rank or settings.max_lora_rank
    findings = check_adapter_for_vllm(
        config,
        list(tensors),
        architecture=arch,
        max_lora_rank=rank,
        base_vocab_size=base_cfg.get("vocab_size"),
        adapter_vocab_size=adapter_vocab,
    )
    return AdapterCheck(adapter=adapter, architecture=arch, max_lora_rank=rank, findings=findings)


def export_adapter(settings: MergerSettings, check: AdapterCheck, dest: Path) -> Path:
    """Copy the files vLLM reads into `dest` (new or empty), with the check's verdict."""
    if check.errors:
        raise Refused(
            f"{check.adapter.ref} is not loadable by vLLM; nothing exported",
            "; ".join(f.hint for f in check.errors),
        )
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest} is not empty", "choose an empty or new folder")
    dest.mkdir(parents=True, exist_ok=True)
    src = open_store(settings).fetch(check.adapter)
    for name in SERVING_FILES:
        shutil.copyfile(src / name, dest / name)
    (dest / "vllm-check.json").write_text(json.dumps(check.as_dict(), indent=2) + "\n")
    return dest
