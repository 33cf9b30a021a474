"""Artifact manifests, names and content digests.

An artifact is a folder of files plus a JSON manifest. The manifest records every
file's size and sha256, who produced it, what it was made from (parents, by digest)
and the config that made it. The artifact digest is a hash of the file list alone, so
two publishes of the same bytes under other names have the same digest.

Names: one or more segments joined by "/", each made of letters, digits, ".", "_" and
"-", starting with a letter or digit, at most 64 characters per segment and 200 in all.
Versions: one segment of the same characters. No "..", no absolute paths, no empty
segments. File paths inside an artifact follow the same rules, segment by segment.

Refs: `NAME` (the latest version), `NAME:VERSION`, or `NAME@LABEL` (the version a label
points at now, e.g. `runs/demo/adapter@promoted`; labels live in the store, see
`lorastack.store.labels`). A label is one segment starting with a letter that does not
look like a served version suffix (`v3`).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from lorastack import __version__
from lorastack.errors import InvalidName

SCHEMA_VERSION = 1
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")
_VERSION_SUFFIX = re.compile(r"^v[0-9]+$")  # `<name>-v<version>` is a served adapter's name
_CHUNK = 1 << 20  # bytes read at a time when hashing

KINDS = ("base-model", "dataset", "adapter", "checkpoint", "merged-model", "report")


def validate_name(name: str, what: str = "artifact name") -> str:
    """Return `name` if it follows the naming rules, else raise InvalidName."""
    if not name or len(name) > 200 or name.startswith("/") or "\\" in name:
        raise InvalidName(
            f"invalid {what} {name!r}",
            "use segments of letters, digits, '.', '_' and '-' joined by '/', e.g. 'smollm2/base'",
        )
    for seg in name.split("/"):
        if not _SEGMENT.match(seg) or seg in (".", "..") or ".." in seg:
            raise InvalidName(
                f"invalid {what} {name!r}: segment {seg!r} is empty, '..' or has other characters",
                "each segment starts with a letter or digit and holds only letters, digits, "
                "'.', '_' and '-' (at most 64 characters)",
            )
    return name


def validate_version(version: str) -> str:
    if "/" in version:
        raise InvalidName(f"invalid version {version!r}", "a version is one segment, e.g. '3'")
    return validate_name(version, "version")


def validate_label(label: str) -> str:
    """Return `label` if it may name a label (`NAME@LABEL`), else raise InvalidName."""
    if not _LABEL.match(label) or _VERSION_SUFFIX.match(label):
        raise InvalidName(
            f"invalid label {label!r}",
            "a label is one word of letters, digits, '.', '_' and '-' starting with a letter "
            "and not of the form v<digits>, e.g. 'promoted'",
        )
    return label


def split_ref(ref: str) -> tuple[str, str | None, str | None]:
    """Split 'NAME', 'NAME:VERSION' or 'NAME@LABEL' into (name, version, label)."""
    if "@" in ref:
        name, _, label = ref.partition("@")
        if ":" in label:
            raise InvalidName(
                f"invalid ref {ref!r}: a ref names a version or a label, not both",
                "write NAME:VERSION or NAME@LABEL",
            )
        return validate_name(name), None, validate_label(label)
    name, _, version = ref.partition(":")
    validate_name(name)
    if version:
        validate_version(version)
    return name, version or None, None


def parse_ref(ref: str) -> tuple[str, str | None]:
    """Split 'NAME[:VERSION]' into (name, version or None for the latest). 'NAME@LABEL' is
    accepted and gives (name, None): only the store knows which version a label names."""
    name, version, _ = split_ref(ref)
    return name, version


def served_name(model_ref: str, served_model_name: str = "") -> str:
    """The model id vLLM serves a store ref under: `served_model_name`, else the ref's last
    path segment without its version. One rule for inference and the gateway's tokenizers."""
    name, _ = parse_ref(model_ref)
    return served_model_name or name.rsplit("/", 1)[-1]


def served_label_name(name: str, label: str) -> str:
    """The adapter id vLLM serves `NAME@LABEL` under: `NAME-LABEL`, the same whichever
    version the label points at (a version is served as `NAME-vVERSION`)."""
    return validate_name(f"{name}-{validate_label(label)}", "served adapter name")


class FileEntry(BaseModel):
    path: str  # relative, '/'-separated
    size: int = Field(ge=0)  # bytes
    sha256: str


class Producer(BaseModel):
    service: str
    version: str = __version__
    git_commit: str = ""


class Parent(BaseModel):
    role: str  # e.g. "base", "dataset", "adapter"
    name: str
    version: str
    digest: str


class Manifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    kind: str
    name: str
    version: str
    digest: str  # sha256 of the file list, see content_digest()
    files: list[FileEntry]
    created: str
    producer: Producer
    parents: list[Parent] = []
    config: dict[str, Any] = {}
    metadata: dict[str, Any] = {}

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def as_parent(self, role: str) -> Parent:
        return Parent(role=role, name=self.name, version=self.version, digest=self.digest)

    def to_json(self) -> bytes:
        return (self.model_dump_json(indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        return cls.model_validate(json.loads(raw))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def content_digest(files: list[FileEntry]) -> str:
    """Digest of an artifact's content: its sorted (path, size, sha256) list."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda e: e.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return "sha256:" + h.hexdigest()


def walk_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """Yield (relative posix path, absolute path) for every regular file, sorted."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            rel = p.relative_to(folder).as_posix()
            for seg in rel.split("/"):
                validate_name(seg, f"file name in {folder}")
            yield rel, p


def scan_folder(folder: Path) -> list[FileEntry]:
    return [
        FileEntry(path=rel, size=p.stat().st_size, sha256=sha256_file(p))
        for rel, p in walk_files(folder)
    ]


def git_commit() -> str:
    """The commit of the running code when it is a git checkout, else ''."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
