"""`ArtifactStore`: publish, look up, fetch and copy artifacts over any backend.

Owns versioning (the next integer when none is given), the publish order (blobs,
then manifest), and which files of which artifact are fetched where: the local cache
(`CACHE/blobs/<sha256>` and `CACHE/artifacts/<digest>/`). Filling it, with every
downloaded file verified against its sha256, is lorastack.store.fetching; the cache's
records of what was verified, checks on use and full re-hash are lorastack.store.cache.
It knows nothing of what an artifact contains.

Every manifest it reads is checked (lorastack.manifest.read_manifest: paths, sha256s,
digest, name and version against the key) before any path is built from it, and `fetch`
checks the manifest it is handed again, so a manifest written by whoever can write to
the store never reaches outside the cache and the destination.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, Conflict, IntegrityError, NotFound
from lorastack.manifest import (
    KINDS,
    FileEntry,
    Manifest,
    Parent,
    Producer,
    check_manifest,
    content_digest,
    git_commit,
    now_iso,
    read_manifest,
    scan_folder,
    split_ref,
    validate_name,
    validate_version,
    walk_files,
)
from lorastack.settings import CommonSettings
from lorastack.store import labels as label_store
from lorastack.store.backend import Backend
from lorastack.store.fetching import download_checked, materialise
from lorastack.store.labels import LabelRecord

log = logging.getLogger(__name__)
_AUTO_VERSION_TRIES = 5
LINK_MIN_BYTES = 16 << 20  # fetch: from a local store, files this large are linked, not copied


def _version_key(v: str) -> tuple[int, int | str]:
    return (0, int(v)) if v.isdigit() else (1, v)


def _check_publishable(folder: Path, kind: str, name: str, version: str | None) -> None:
    """Refuse an unknown kind, a bad name or version, or a `folder` that is none."""
    if kind not in KINDS:
        raise ConfigError(f"unknown artifact kind {kind!r}", f"use one of {', '.join(KINDS)}")
    validate_name(name)
    if version is not None:
        validate_version(version)
    if not folder.is_dir():
        raise NotFound(f"{folder} is not a folder", "publish a folder of files")


class ArtifactStore:
    """Publish, resolve, fetch and label artifacts over a storage backend, with a verified cache."""

    def __init__(self, backend: Backend, cache_dir: Path) -> None:
        self.backend = backend
        self.cache_dir = cache_dir
        self.url = backend.url

    # ---- publishing -------------------------------------------------------------

    def publish(
        self,
        folder: Path,
        *,
        kind: str,
        name: str,
        service: str,
        version: str | None = None,
        parents: Iterable[Parent] = (),
        config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        hand_over: bool = False,
    ) -> Manifest:
        """Upload every file of `folder`, then write the manifest exclusively.

        `hand_over`: the caller gives up its files of LINK_MIN_BYTES or more (a merger's
        16 GB of fresh shards): on a store on this file system they are made read-only,
        stamped and hashed, then hard-linked in as blobs instead of copied (no second
        16 GB on the disk, no copy's time). They stay in `folder`, read-only; a file
        written between its hash and its link is refused (IntegrityError)."""
        _check_publishable(folder, kind, name, version)
        files = self._upload(folder, hand_over)
        for _ in range(_AUTO_VERSION_TRIES):
            ver = version or self._next_version(name)
            manifest = Manifest(
                kind=kind,
                name=name,
                version=ver,
                digest=content_digest(files),
                files=files,
                created=now_iso(),
                producer=Producer(service=service, git_commit=git_commit()),
                parents=list(parents),
                config=config or {},
                metadata=metadata or {},
            )
            try:
                self.backend.put_manifest(name, ver, manifest.to_json())
                return manifest
            except Conflict:
                if version is not None:
                    raise
        raise Conflict(
            f"could not take a new version of {name} after {_AUTO_VERSION_TRIES} tries",
            "another writer is publishing the same name; retry, or give an explicit version",
        )

    def _upload(self, folder: Path, hand_over: bool) -> list[FileEntry]:
        """Put every file of `folder` as a blob (linked in where handed over, see publish);
        the files as the manifest lists them."""
        by_path = dict(walk_files(folder))
        # a store on this disk (LocalBackend) can take files by a link; others copy them
        adopt = getattr(self.backend, "adopt_blob", None) if hand_over else None
        freeze = getattr(self.backend, "freeze", None) if adopt else None
        frozen = {
            rel
            for rel, p in by_path.items()
            if freeze and p.stat().st_size >= LINK_MIN_BYTES and freeze(p)
        }  # frozen before they are hashed: the hash is of what will be linked
        files = scan_folder(folder)
        if not files:
            raise ConfigError(f"{folder} holds no files", "an artifact needs at least one file")
        for f in files:
            if f.path not in frozen:
                self.backend.put_blob(f.sha256, by_path[f.path])
            elif adopt is None or not adopt(f.sha256, by_path[f.path], f.size):
                raise IntegrityError(
                    f"{folder / f.path} was written to while it was published",
                    "publish again once nothing writes to the folder",
                )
        return files

    def _next_version(self, name: str) -> str:
        numbers = [int(v) for v in self.versions(name) if v.isdigit()]
        return str(max(numbers, default=0) + 1)

    # ---- lookups ----------------------------------------------------------------

    def versions(self, name: str) -> list[str]:
        """The versions of `name`, in version order."""
        validate_name(name)
        found = [v for n, v in self.backend.list_manifests(name) if n == name]
        return sorted(found, key=_version_key)

    def manifest(self, name: str, version: str | None = None) -> Manifest:
        """The manifest of `name:version`, or of the latest version when None."""
        validate_name(name)
        if version is None:
            versions = self.versions(name)
            if not versions:
                raise NotFound(
                    f"no artifact named {name!r} in {self.url}",
                    "list what exists with 'lorastack store ls'",
                )
            version = versions[-1]
        validate_version(version)
        return self._read(name, version)

    def _read(self, name: str, version: str) -> Manifest:
        """The checked manifest stored under `name:version` (InvalidManifest names the field)."""
        raw = self.backend.get_manifest(name, version)
        return read_manifest(raw, f"manifest {name}:{version} in {self.url}", name, version)

    def find(self, name: str, digest: str) -> Manifest | None:
        """The newest version of `name` whose content digest is `digest`, if any."""
        for version in reversed(self.versions(name)):
            m = self.manifest(name, version)
            if m.digest == digest:
                return m
        return None

    def resolve(self, ref: str) -> Manifest:
        """Look up 'NAME', 'NAME:VERSION' or 'NAME@LABEL' (the version the label names now)."""
        name, version, label = split_ref(ref)
        if label is None:
            return self.manifest(name, version)
        record = label_store.current(self.backend, name, label)
        try:
            manifest = self.manifest(name, record.version)
        except NotFound:
            raise NotFound(
                f"{record.ref} points at {record.target}, which is no longer in {self.url}",
                f"move the label to a published version: lorastack promote {name}:VERSION",
            ) from None
        if manifest.digest != record.digest:
            raise IntegrityError(
                f"{record.target} is not the content {record.ref} was set on "
                f"({manifest.digest[:19]}…, label says {record.digest[:19]}…)",
                "the version was deleted and published again; promote it again on its evidence",
            )
        return manifest

    # ---- labels (NAME@LABEL, see lorastack.store.labels) ------------------------

    def label(self, name: str, label: str) -> LabelRecord:
        """The record in force for `NAME@LABEL`."""
        return label_store.current(self.backend, name, label)

    def label_history(self, name: str, label: str) -> list[LabelRecord]:
        """The records of `label` on `name`, oldest first."""
        return label_store.history(self.backend, name, label)

    def labels(self, prefix: str = "") -> list[LabelRecord]:
        """The record in force of every label whose artifact name starts with `prefix`."""
        return label_store.all_current(self.backend, prefix)

    def move_label(
        self,
        label: str,
        target: Manifest,
        *,
        forced: bool = False,
        reason: str = "",
        evidence: dict[str, Any] | None = None,
    ) -> LabelRecord:
        """Point `TARGET_NAME@label` at `target` (a published version), keeping the history."""
        published = self.manifest(target.name, target.version)
        if published.digest != target.digest:
            raise Conflict(
                f"{target.ref} in {self.url} is other content than the one given",
                "look it up again with 'lorastack store show'",
            )
        return label_store.move(
            self.backend, label, published, forced=forced, reason=reason, evidence=evidence
        )

    def ls(self, prefix: str = "") -> list[Manifest]:
        """Every published version whose name starts with `prefix`, sorted."""
        pairs = sorted(
            self.backend.list_manifests(prefix), key=lambda p: (p[0], _version_key(p[1]))
        )
        return [self._read(n, v) for n, v in pairs]

    def delete(self, name: str, version: str) -> None:
        """Unpublish one version (its blobs stay until garbage-collected)."""
        self.backend.delete_manifest(validate_name(name), validate_version(version))

    # ---- fetching ---------------------------------------------------------------

    def fetch(self, manifest: Manifest) -> Path:
        """A verified local folder holding the artifact, from the cache when it is intact.

        From a store on this machine's disk (file://), files of LINK_MIN_BYTES or more are
        hard links to the store's read-only blobs, not copies: an 8B base is on disk once,
        and its first use costs no copy and no hash (the store hashed it when it was
        published; `lorastack store verify` hashes it again). Should such a file be
        edited in place anyway, the change reaches the store's blob and moves its mtime
        off the one it was stored with: the check on use and every later fetch then
        download and verify it against the sha256, and refuse it with IntegrityError
        rather than hand it out."""
        check_manifest(manifest, f"manifest {manifest.ref} for {self.url}")
        target = self.cache_dir / "artifacts" / manifest.digest.removeprefix("sha256:")
        return materialise(
            self.backend, self.cache_dir, manifest, manifest.files, target, LINK_MIN_BYTES
        )

    def fetch_files(self, manifest: Manifest, paths: Iterable[str]) -> Path:
        """A verified local folder holding only the files of `manifest` named in `paths`
        (those it has; the others are skipped): a tokenizer without the weights beside it.
        Each file is downloaded and checked against its sha256 exactly as `fetch` does,
        and cached apart from the whole artifact, under the digest and the selection."""
        check_manifest(manifest, f"manifest {manifest.ref} for {self.url}")
        wanted = set(paths)
        files = [f for f in manifest.files if f.path in wanted]
        if not files:
            raise NotFound(
                f"{manifest.ref} has none of the files {', '.join(sorted(wanted))}",
                f"check its files with 'lorastack store show {manifest.ref}'",
            )
        chosen = hashlib.sha256("\n".join(sorted(f.path for f in files)).encode()).hexdigest()
        digest = manifest.digest.removeprefix("sha256:")
        target = self.cache_dir / "artifacts" / f"{digest}-only-{chosen[:16]}"
        return materialise(self.backend, self.cache_dir, manifest, files, target, LINK_MIN_BYTES)

    def get(self, manifest: Manifest, dest: Path) -> Path:
        """Copy the verified artifact into `dest` (created; must be empty if it exists)."""
        if dest.exists() and any(dest.iterdir()):
            raise ConfigError(f"{dest} is not empty", "choose an empty or new folder")
        # plain copies: the cache's links to a local store's blobs are read-only
        shutil.copytree(
            self.fetch(manifest), dest, dirs_exist_ok=True, copy_function=shutil.copyfile
        )
        return dest

    def verify_remote(self, manifest: Manifest) -> None:
        """Read `manifest` back from the store and download every file of it afresh (never
        from the cache), checking each sha256: the proof that the store itself holds the
        artifact. Raises IntegrityError (a file or the manifest differs), NotFound or
        StoreUnavailable."""
        stored = self.manifest(manifest.name, manifest.version)
        if stored.digest != manifest.digest:
            raise IntegrityError(
                f"{manifest.ref} in {self.url} has digest {stored.digest[:19]}…, "
                f"not the published {manifest.digest[:19]}…",
                "another writer replaced it; publish the artifact again under a new version",
            )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix=".verify-") as scratch:
            for f in stored.files:
                download_checked(self.backend, stored, f.path, f.sha256, Path(scratch)).unlink()


def open_store(settings: CommonSettings) -> ArtifactStore:
    """Build the store named by `settings.resolved_store_url`."""
    url = settings.resolved_store_url
    cache = settings.resolved_cache_dir
    if url.startswith("file://"):
        from lorastack.store.local import LocalBackend

        return ArtifactStore(LocalBackend(Path(url.removeprefix("file://")).expanduser()), cache)
    if url.startswith("s3://"):
        from lorastack.store.s3 import S3Backend

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"store URL {url!r} names no bucket", "use s3://BUCKET[/PREFIX]")
        return ArtifactStore(S3Backend(bucket, prefix, settings), cache)
    raise ConfigError(
        f"unsupported store URL {url!r}", "use file:///ABSOLUTE/DIR or s3://BUCKET[/PREFIX]"
    )
