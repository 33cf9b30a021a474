"""Artifact manifests, names and content digests.

An artifact is a folder of files plus a JSON manifest. The manifest records every
file's size and sha256, who produced it, what it was made from (parents, by digest)
and the config that made it. The artifact digest is a hash of the file list alone, so
two publishes of the same bytes under other names have the same digest.

Names: one or more segments joined by "/", each made of letters, digits, ".", "_" and
"-", starting with a letter or digit, at most 64 characters per segment and 200 in all.
Versions: one segment of the same characters. No "..", no absolute paths, no empty
segments. File paths inside an artifact follow the same rules, segment by segment.

A manifest is data from the store, so whoever can write to the store writes it: every
reader takes it through `read_manifest` (fetch through `check_manifest`), which refuses
with InvalidManifest, naming the field, a path that is not relative and normalised, a
sha256 that is not 64 lowercase hex digits, a digest other than the one computed from
the file list, a name or version other than the key it was read from. Cache paths
(`CACHE/blobs/<sha256>`, `CACHE/artifacts/<digest>/<path>`) are built from those checked
values only.

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
from typing import Any, NoReturn

from pydantic import BaseModel, Field, ValidationError

from lorastack import __version__
from lorastack.errors import InvalidManifest, InvalidName, field_errors

SCHEMA_VERSION = 1
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")
_VERSION_SUFFIX = re.compile(r"^v[0-9]+$")  # `<name>-v<version>` is a served adapter's name
_SHA256 = re.compile(r"[0-9a-f]{64}")  # fullmatch only: `$` would let a trailing "\n" in
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
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
        if not _SEGMENT.fullmatch(seg) or seg in (".", "..") or ".." in seg:
            raise InvalidName(
                f"invalid {what} {name!r}: segment {seg!r} is empty, '..' or has other characters",
                "each segment starts with a letter or digit and holds only letters, digits, "
                "'.', '_' and '-' (at most 64 characters)",
            )
    return name


def validate_version(version: str) -> str:
    """A valid version: one name segment; InvalidName otherwise."""
    if "/" in version:
        raise InvalidName(f"invalid version {version!r}", "a version is one segment, e.g. '3'")
    return validate_name(version, "version")


def validate_label(label: str) -> str:
    """Return `label` if it may name a label (`NAME@LABEL`), else raise InvalidName."""
    if not _LABEL.fullmatch(label) or _VERSION_SUFFIX.fullmatch(label):
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
    """One file of an artifact: path, size and SHA-256."""

    path: str  # relative, '/'-separated
    size: int = Field(ge=0)  # bytes
    sha256: str


class Producer(BaseModel):
    """What published an artifact: the service, its version and git commit."""

    service: str
    version: str = __version__
    git_commit: str = ""


class Parent(BaseModel):
    """An artifact another one was made from, by role, name, version and digest."""

    role: str  # e.g. "base", "dataset", "adapter"
    name: str
    version: str
    digest: str


class Manifest(BaseModel):
    """An artifact version: its kind, name, files with their digests, parents and metadata."""

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
        """This artifact as a Parent of another, in `role`."""
        return Parent(role=role, name=self.name, version=self.version, digest=self.digest)

    def to_json(self) -> bytes:
        """The manifest as indented JSON bytes, the way it is stored."""
        return (self.model_dump_json(indent=2) + "\n").encode()


_REPUBLISH = (
    "the manifest was edited or damaged in the store: publish the artifact again from its "
    "source, and check who can write to the store"
)


def _refuse(where: str, field: str, value: object, why: str) -> NoReturn:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise InvalidManifest(f"{where}: {field} {shown} {why}", _REPUBLISH)


def path_problem(path: str) -> str:
    """Why `path` may not name a file inside an artifact ('' when it may): it must be
    relative and normalised, '/'-separated segments of the naming rules (so no '..', '.',
    empty segment, leading '/', backslash or NUL)."""
    if not path:
        return "is empty"
    if path.startswith("/"):
        return "is absolute"
    if "\\" in path or "\0" in path:
        return "holds a backslash or a NUL"
    for seg in path.split("/"):
        if seg in ("", ".", "..") or ".." in seg or not _SEGMENT.fullmatch(seg):
            return f"is not a relative, normalised path (segment {seg!r})"
    return ""


def check_manifest(
    m: Manifest, where: str, name: str | None = None, version: str | None = None
) -> Manifest:
    """Return `m` when every field a reader builds paths or trust on is sound, else raise
    InvalidManifest naming the field. `name`/`version`: the key it was read from."""
    if name is not None and m.name != name:
        _refuse(where, "name", m.name, f"is not the name it is stored under ({name!r})")
    if version is not None and m.version != version:
        _refuse(where, "version", m.version, f"is not the version it is stored under ({version!r})")
    for field, check in (("name", validate_name), ("version", validate_version)):
        try:
            check(getattr(m, field))
        except InvalidName:
            _refuse(where, field, getattr(m, field), "breaks the naming rules")
    if m.kind not in KINDS:
        _refuse(where, "kind", m.kind, f"is none of {', '.join(KINDS)}")
    seen: set[str] = set()
    for i, f in enumerate(m.files):
        if why := path_problem(f.path):
            _refuse(where, f"files[{i}].path", f.path, why)
        if f.path in seen:
            _refuse(where, f"files[{i}].path", f.path, "is listed twice")
        seen.add(f.path)
        if not _SHA256.fullmatch(f.sha256):
            _refuse(where, f"files[{i}].sha256", f.sha256, "is not 64 lowercase hex digits")
    folders = {p.rsplit("/", 1)[0] for p in seen if "/" in p}
    for i, f in enumerate(m.files):
        if f.path in folders or any(d.startswith(f.path + "/") for d in folders):
            _refuse(where, f"files[{i}].path", f.path, "is also the folder of another file")
    if not _DIGEST.fullmatch(m.digest):
        _refuse(where, "digest", m.digest, "is not 'sha256:' and 64 lowercase hex digits")
    if m.digest != content_digest(m.files):
        _refuse(where, "digest", m.digest, "is not the digest of the manifest's file list")
    for i, p in enumerate(m.parents):
        try:
            validate_name(p.name)
            validate_version(p.version)
        except InvalidName:
            _refuse(where, f"parents[{i}]", f"{p.name}:{p.version}", "breaks the naming rules")
        if not _DIGEST.fullmatch(p.digest):
            _refuse(where, f"parents[{i}].digest", p.digest, "is not 'sha256:' and 64 hex digits")
    return m


def read_manifest(raw: bytes, where: str, name: str, version: str) -> Manifest:
    """Parse and check the manifest stored under `name:version` (`where` names it in errors)."""
    try:
        m = Manifest.model_validate(json.loads(raw))
    except ValueError as e:  # not JSON, or pydantic's ValidationError (a ValueError)
        fields = (
            "; ".join(f"{loc}: {msg}" for loc, msg in field_errors(e, "manifest"))
            if isinstance(e, ValidationError)
            else f"not JSON ({e})"
        )
        raise InvalidManifest(f"{where}: {fields[:300]}", _REPUBLISH) from None
    return check_manifest(m, where, name, version)


def sha256_file(path: Path) -> str:
    """The SHA-256 of the file at `path` (hex), read in chunks."""
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
    """The FileEntry of every file under `folder`, hashed."""
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
    """The time now in UTC, ISO 8601 to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")
