"""`file://DIR` backend: the embedded default. It persists and needs no server.

Atomicity comes from the file system: blobs are written to a temporary file and
renamed into place, read-only and with the mtime STORED_MTIME_NS (as Nix stamps its
store), so a blob that was ever written after it was stored shows it, and a cache can
hard-link the others instead of copying them (lorastack.store.artifacts); a publisher
that hands its large files over (ArtifactStore.publish(hand_over=True)) has them frozen
with those marks before they are hashed and hard-linked in as blobs, not copied; manifests
are hard-linked into place, which fails if the name exists, so the first
writer wins and nobody ever reads a partial manifest.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from lorastack.errors import Conflict, NotFound
from lorastack.store.backend import RecordManifests, blob_key, manifest_key

STORED_MTIME_NS = 1_000_000_000  # every stored blob's mtime: 1970-01-01T00:00:01Z


class LocalBackend(RecordManifests):
    """The `file://DIR` backend: blobs and manifests as files under one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        (root / "tmp").mkdir(parents=True, exist_ok=True)

    def _tmp(self) -> Path:
        fd, name = tempfile.mkstemp(dir=self.root / "tmp")
        os.close(fd)
        return Path(name)

    def has_blob(self, sha256: str) -> bool:
        """Whether the blob's file is under blobs/."""
        return (self.root / blob_key(sha256)).is_file()

    def blob_path(self, sha256: str) -> Path:
        """Where the blob lies on this machine's disk (it may not exist)."""
        return self.root / blob_key(sha256)

    def unchanged_blob(self, sha256: str, size: int) -> Path | None:
        """The blob's path when it still has the size and the mtime it was stored with
        (nothing wrote to it since); None otherwise."""
        try:
            st = self.blob_path(sha256).stat()
        except OSError:
            return None
        if st.st_size != size or st.st_mtime_ns != STORED_MTIME_NS:
            return None
        return self.blob_path(sha256)

    def put_blob(self, sha256: str, src: Path) -> None:
        """Copy `src` under blobs/, read-only, atomically (rename); kept if already there."""
        dest = self.blob_path(sha256)
        if dest.is_file():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp()
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o444)
        os.utime(tmp, ns=(STORED_MTIME_NS, STORED_MTIME_NS))
        os.replace(tmp, dest)

    def freeze(self, path: Path) -> bool:
        """Give the file `path` a stored blob's marks where it lies (read-only, mtime
        STORED_MTIME_NS) before it is hashed, when it is on this store's file system, so
        it can become the blob by a hard link (adopt_blob) instead of a copy; False, and
        the file untouched, where it is on another file system."""
        if path.stat().st_dev != self.root.stat().st_dev:
            return False
        os.chmod(path, 0o444)
        os.utime(path, ns=(STORED_MTIME_NS, STORED_MTIME_NS))
        return True

    def adopt_blob(self, sha256: str, src: Path, size: int) -> bool:
        """Hard-link the frozen file `src`, hashed after `freeze`, in as the blob `sha256`:
        no copy (a copy where the file system refuses the link). False where `src` was
        written since it was frozen (its size or mtime moved: the hash may not be its
        content). A write after the link moves the blob's mtime too, which every fetch
        checks (unchanged_blob)."""
        dest = self.blob_path(sha256)
        if dest.is_file():
            return True
        st = src.stat()
        if st.st_size != size or st.st_mtime_ns != STORED_MTIME_NS:
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "tmp" / f"link-{uuid.uuid4().hex}"
        try:
            os.link(src, tmp)
            os.replace(tmp, dest)  # atomic: a reader sees no blob or the whole one
        except OSError:
            self.put_blob(sha256, src)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def download_blob(self, sha256: str, dest: Path) -> None:
        """Copy the blob's file to `dest`; NotFound if it is missing."""
        src = self.blob_path(sha256)
        if not src.is_file():
            raise NotFound(f"blob {sha256} is missing from {self.url}")
        shutil.copyfile(src, dest)

    def put_record(self, key: str, data: bytes) -> None:
        """Write the record file exclusively (a hard link of a temporary file)."""
        dest = self.root / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp()
        try:
            tmp.write_bytes(data)
            os.link(tmp, dest)  # exclusive and atomic: fails if dest exists
        except FileExistsError:
            raise Conflict(f"{key} already exists in {self.url}", "write the next one") from None
        finally:
            tmp.unlink(missing_ok=True)

    def get_record(self, key: str) -> bytes:
        """Read the record file; NotFound if absent."""
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{key} is not in {self.url}") from None

    def list_records(self, prefix: str) -> list[str]:
        """The .json files under `prefix`'s top folder whose keys start with `prefix`, sorted."""
        top = self.root / prefix.split("/", 1)[0]
        if not top.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in top.rglob("*.json"))
        return sorted(k for k in keys if k.startswith(prefix))

    def delete_manifest(self, name: str, version: str) -> None:
        """Remove the manifest file, if present."""
        (self.root / manifest_key(name, version)).unlink(missing_ok=True)

    def list_manifests(self, prefix: str) -> list[tuple[str, str]]:
        """Walk manifests/ for @VERSION.json files whose name starts with `prefix`."""
        base = self.root / "manifests"
        out = []
        for p in base.rglob("@*.json") if base.is_dir() else []:
            name = p.parent.relative_to(base).as_posix()
            if name.startswith(prefix):
                out.append((name, p.name[1:-5]))
        return out
