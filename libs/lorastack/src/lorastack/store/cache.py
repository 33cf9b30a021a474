"""The local cache of verified artifacts: what was verified, checked on every use, and
the full re-hash.

`CACHE/artifacts/<digest>/` holds a fetched artifact, and `CACHE/artifacts/<digest>.stat.json`
records each file's size, mtime (ns) and sha256 when it was verified. The check on
every use is cheap: a file whose size or mtime differs is hashed again, and a cached
artifact with a bad or missing file is thrown away (renamed first, so no reader meets
it half deleted) to be fetched again before anyone is handed it. Damage that keeps size
and mtime (bit rot) is what `verify_cache` (`lorastack store verify`) is for: it hashes
everything, `CACHE/blobs/<sha256>` included. Fetching itself is the store's
(lorastack.store.artifacts), and so are the large files it hard-links from a store on
this disk instead of copying.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lorastack.manifest import FileEntry, path_problem, sha256_file

STAMP_SUFFIX = ".stat.json"  # beside CACHE/artifacts/<digest>/: path -> [size, mtime_ns, sha256]


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + STAMP_SUFFIX)


def write_stamp(folder: Path, target: Path, files: list[FileEntry]) -> None:
    """Record size and mtime of the verified files in `folder` (about to become `target`)."""
    stats = {f.path: (folder / f.path).stat() for f in files}
    data = {f.path: [stats[f.path].st_size, stats[f.path].st_mtime_ns, f.sha256] for f in files}
    tmp = _stamp(target).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, _stamp(target))


def cache_damage(target: Path, files: list[FileEntry]) -> list[str]:
    """Paths of cached files that are missing or no longer hash to their sha256; only
    files whose size or mtime differ from the stamp are hashed (all, with no stamp)."""
    try:
        stamp = json.loads(_stamp(target).read_text())
    except (OSError, ValueError):
        stamp = {}
    damaged, rehashed = [], False
    for f in files:
        try:
            st = (target / f.path).stat()
        except OSError:
            damaged.append(f.path)
            continue
        if stamp.get(f.path) == [st.st_size, st.st_mtime_ns, f.sha256]:
            continue
        rehashed = True
        if st.st_size != f.size or sha256_file(target / f.path) != f.sha256:
            damaged.append(f.path)
    if rehashed and not damaged:
        write_stamp(target, target, files)  # intact after all (e.g. touched): note it
    return damaged


def discard(folder: Path) -> None:
    """Remove a cached folder: renamed first, so no reader meets it half deleted."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    os.rename(folder, trash)
    _stamp(folder).unlink(missing_ok=True)
    shutil.rmtree(trash, ignore_errors=True)


def verify_cache(cache_dir: Path) -> tuple[int, list[str]]:
    """Hash every cached file (`lorastack store verify`): (files checked, problems). A
    damaged artifact or blob is removed, so its next use downloads it again."""
    checked, problems = 0, []
    artifacts = cache_dir / "artifacts"
    for stamp in sorted(artifacts.glob("*" + STAMP_SUFFIX)) if artifacts.is_dir() else []:
        target = stamp.with_name(stamp.name.removesuffix(STAMP_SUFFIX))
        try:
            recorded = json.loads(stamp.read_text())
        except (OSError, ValueError):
            recorded = None
        if (
            not isinstance(recorded, dict)
            or not target.is_dir()
            # a record whose paths leave the folder is none of ours: never touch what it names
            or any(path_problem(p) for p in recorded)
        ):
            problems.append(f"{target.name[:12]}: unreadable cache record; removed")
            if target.is_dir():
                discard(target)
            stamp.unlink(missing_ok=True)
            continue
        bad = []
        for path, (_size, _mtime, sha) in sorted(recorded.items()):
            checked += 1
            file = target / path
            if not file.is_file() or sha256_file(file) != sha:
                bad.append(path)
                if file.is_file():
                    # it may be a local store's blob (linked): marked changed, every
                    # later fetch verifies it instead of linking it again
                    os.utime(file)
        if bad:
            problems.append(f"artifact {target.name[:12]}: damaged {', '.join(bad)}; removed")
            discard(target)
    blobs = cache_dir / "blobs"
    for blob in sorted(blobs.iterdir()) if blobs.is_dir() else []:
        if blob.name.startswith("."):
            continue
        checked += 1
        if sha256_file(blob) != blob.name:
            problems.append(f"blob {blob.name[:12]}: damaged; removed")
            blob.unlink()
    return checked, problems
