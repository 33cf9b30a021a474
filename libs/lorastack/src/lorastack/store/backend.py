"""The storage boundary: the few byte-level operations a backend must offer.

Owns nothing about manifests, digests or caching; `ArtifactStore` builds those on top.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from lorastack.errors import Conflict, NotFound


def blob_key(sha256: str) -> str:
    """Where a blob with this SHA-256 lives in a backend."""
    return f"blobs/sha256/{sha256[:2]}/{sha256}"


def manifest_key(name: str, version: str) -> str:
    """Where the manifest of NAME:VERSION lives in a backend."""
    return f"manifests/{name}/@{version}.json"


def label_key(name: str, label: str, seq: int) -> str:
    """One record of a label's history; `seq` is zero-padded so keys sort by it."""
    return f"{LABELS}{name}/@{label}/{seq:08d}.json"


LABELS = "labels/"  # key prefix of every label record


class Backend(Protocol):
    """What a storage backend offers: blobs by SHA-256, manifests and records by key."""

    url: str

    def has_blob(self, sha256: str) -> bool:
        """Whether the blob with this sha256 is stored."""

    def put_blob(self, sha256: str, src: Path) -> None:
        """Store `src` under its sha256; storing the same blob twice is harmless."""

    def download_blob(self, sha256: str, dest: Path) -> None:
        """Write the blob's bytes to `dest` (unverified; the caller checks the hash)."""

    def put_manifest(self, name: str, version: str, data: bytes) -> None:
        """Create the manifest; raise Conflict if this version already exists."""

    def get_manifest(self, name: str, version: str) -> bytes:
        """Return the manifest bytes; raise NotFound if absent."""

    def delete_manifest(self, name: str, version: str) -> None:
        """Remove the manifest of NAME:VERSION; nothing if it is absent."""

    def list_manifests(self, prefix: str) -> list[tuple[str, str]]:
        """(name, version) of every manifest whose name starts with `prefix`."""

    def put_record(self, key: str, data: bytes) -> None:
        """Create the small object `key` (e.g. a label record); raise Conflict if it exists."""

    def get_record(self, key: str) -> bytes:
        """Return the bytes of `key`; raise NotFound if absent."""

    def list_records(self, prefix: str) -> list[str]:
        """Every record key that starts with `prefix` (e.g. 'labels/runs/')."""


class RecordManifests:
    """Manifests as records: `put_manifest` / `get_manifest` for a backend that has
    `put_record` / `get_record` (both of ours), with messages that name the version."""

    url: str

    def put_record(self, key: str, data: bytes) -> None:
        """Implemented by the backend (Backend.put_record)."""
        raise NotImplementedError

    def get_record(self, key: str) -> bytes:
        """Implemented by the backend (Backend.get_record)."""
        raise NotImplementedError

    def put_manifest(self, name: str, version: str, data: bytes) -> None:
        """The manifest as a record; Conflict naming the version if it was published."""
        try:
            self.put_record(manifest_key(name, version), data)
        except Conflict:
            raise Conflict(
                f"{name}:{version} was already published in {self.url}",
                "publish under a new version (omit the version to take the next one)",
            ) from None

    def get_manifest(self, name: str, version: str) -> bytes:
        """The manifest record; NotFound naming NAME:VERSION if absent."""
        try:
            return self.get_record(manifest_key(name, version))
        except NotFound:
            raise NotFound(f"{name}:{version} is not in {self.url}") from None
