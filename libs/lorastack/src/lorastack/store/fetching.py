"""Bringing an artifact's files into the local cache, verified: the cache folder
(staged, then renamed into place), hard links to a local store's large blobs, and blobs
downloaded and checked against their sha256.

Owns: the cache's `blobs/<sha256>` and `artifacts/<digest>/` folders as fetching fills
them. Does not own: which artifact (lorastack.store.artifacts), the cache's records and
checks on use (lorastack.store.cache), the backends.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from lorastack.errors import IntegrityError
from lorastack.manifest import FileEntry, Manifest, sha256_file
from lorastack.store.backend import Backend
from lorastack.store.cache import cache_damage, discard, write_stamp

log = logging.getLogger(__name__)


def materialise(
    backend: Backend,
    cache_dir: Path,
    manifest: Manifest,
    files: list[FileEntry],
    target: Path,
    link_min_bytes: int,
) -> Path:
    """`files` of `manifest`, verified, in the cache folder `target` under `cache_dir`
    (`ArtifactStore.fetch`): files of `link_min_bytes` or more linked from a store on this
    disk, the others downloaded and checked against their sha256."""
    if target.is_dir():
        damaged = cache_damage(target, files)
        if not damaged:
            return target
        log.warning(
            "cached %s: %s changed on disk since it was verified; fetching it again",
            manifest.ref,
            ", ".join(damaged),
        )
        discard(target)
        for f in files:
            if f.path in damaged:
                (cache_dir / "blobs" / f.sha256).unlink(missing_ok=True)
    (cache_dir / "artifacts").mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir / "artifacts", prefix=".tmp-"))
    try:
        for f in files:
            dest = staging / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if link_stored(backend, f.sha256, f.size, dest, link_min_bytes):
                continue
            blob = fetch_blob(backend, cache_dir, manifest, f.path, f.sha256)
            try:
                os.link(blob, dest)
            except OSError:
                shutil.copyfile(blob, dest)
        write_stamp(staging, target, files)
        try:
            os.rename(staging, target)
        except OSError:  # another process materialised it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def link_stored(backend: Backend, sha256: str, size: int, dest: Path, link_min_bytes: int) -> bool:
    """Hard-link a large blob of a store on this disk into `dest`; False where the
    store is elsewhere, the file small (a copy keeps an edited config repairable),
    the blob written to since it was stored (the caller then downloads and verifies
    it), or the file system refuses the link."""
    unchanged = getattr(backend, "unchanged_blob", None)
    stored = unchanged(sha256, size) if unchanged and size >= link_min_bytes else None
    if stored is None:
        return False
    try:
        os.link(stored, dest)
    except OSError:
        return False
    return True


def fetch_blob(
    backend: Backend, cache_dir: Path, manifest: Manifest, path: str, sha256: str
) -> Path:
    """One file of an artifact in the local cache, verified against its SHA-256."""
    blob = cache_dir / "blobs" / sha256
    if blob.is_file():
        if sha256_file(blob) == sha256:  # a blob is reused only when a new copy is made
            return blob
        log.warning("cached blob %s of %s is damaged; fetching it again", sha256[:12], path)
        blob.unlink()
    blob.parent.mkdir(parents=True, exist_ok=True)
    tmp = download_checked(backend, manifest, path, sha256, blob.parent)
    try:
        os.replace(tmp, blob)
    finally:
        tmp.unlink(missing_ok=True)
    return blob


def download_checked(
    backend: Backend, manifest: Manifest, path: str, sha256: str, where: Path
) -> Path:
    """Download one blob into a new file in `where`; IntegrityError when its sha256 differs."""
    fd, tmp_name = tempfile.mkstemp(dir=where, prefix=".tmp-")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        backend.download_blob(sha256, tmp)
        h = hashlib.sha256()
        with tmp.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        got = h.hexdigest()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if got != sha256:
        tmp.unlink(missing_ok=True)
        raise IntegrityError(
            f"{manifest.ref}: file {path} is corrupted in {backend.url} "
            f"(sha256 {got[:16]}…, manifest says {sha256[:16]}…)",
            "the stored object was altered or damaged; publish the artifact again from its source",
        )
    return tmp
