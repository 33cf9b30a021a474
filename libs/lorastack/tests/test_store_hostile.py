"""Hostile manifests and records, from the side of someone who can write to the store (a
CI job, a compromised trainer): one field of a real manifest edited, then every reader
(resolve, get, fetch, ls, verify_remote, labels, declared adapters) refuses it with
InvalidManifest naming the field, and no file outside the cache and the destination
appeared, changed or went away. Run against file:// and s3:// (moto on loopback).

Path edits come with their digest recomputed, so the path rule itself is what refuses
them, not the digest check by luck."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lorastack.errors import InvalidManifest
from lorastack.manifest import FileEntry, Manifest, content_digest
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store
from lorastack.store.backend import label_key, manifest_key
from lorastack.store.declared import current as declared_current
from lorastack.store.declared import declaration_key

NAME, VERSION = "demo/base", "1"
Edit = Callable[[dict[str, Any]], None]


def settings_for(kind: str, tmp_path: Path, endpoint: str) -> CommonSettings:
    from lorastack_testing.s3 import s3_settings

    if kind == "file":
        return CommonSettings(home=tmp_path / "home")
    return s3_settings(tmp_path / "home", endpoint)


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, moto_endpoint: str) -> ArtifactStore:
    return open_store(settings_for(request.param, tmp_path, moto_endpoint))


def write_raw(store: ArtifactStore, key: str, data: bytes) -> None:
    """Overwrite a store object behind the store's back, as a writer of the bucket can."""
    if store.url.startswith("file://"):
        path = Path(store.url.removeprefix("file://")) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    backend: Any = store.backend
    backend._client.put_object(Bucket=backend.bucket, Key=backend._key(key), Body=data)


def snapshot(root: Path, skip: list[Path]) -> dict[str, str]:
    """Every file under `root` (but `skip`) with the sha256 of its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        if any(p == s or s in p.parents for s in skip) or not p.is_file():
            continue
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def published(store: ArtifactStore, tmp_path: Path) -> dict[str, Any]:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("hello")
    (src / "sub" / "b.json").write_text('{"x": 1}')
    store.publish(src, kind="base-model", name=NAME, service="test")
    # the victim: a file a hostile manifest would like to replace or delete
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("keep me")
    data: dict[str, Any] = json.loads(store.backend.get_manifest(NAME, VERSION))
    return data


def redigest(m: dict[str, Any]) -> None:
    m["digest"] = content_digest([FileEntry.model_validate(f) for f in m["files"]])


def set_path(value: str, index: int = 0) -> Edit:
    def edit(m: dict[str, Any]) -> None:
        m["files"][index]["path"] = value
        redigest(m)

    return edit


def set_field(field: str, value: str) -> Edit:
    def edit(m: dict[str, Any]) -> None:
        m[field] = value

    return edit


def set_sha256(value: str) -> Edit:
    def edit(m: dict[str, Any]) -> None:
        m["files"][0]["sha256"] = value
        redigest(m)

    return edit


def duplicate(m: dict[str, Any]) -> None:
    m["files"][1]["path"] = m["files"][0]["path"]
    redigest(m)


def other_digest(m: dict[str, Any]) -> None:
    m["digest"] = "sha256:" + "0" * 64  # well formed, but not the file list's


HOSTILE: dict[str, tuple[Edit, str]] = {
    # the table
    "path-dotdot": (set_path("../../../escaped.txt"), r"files\[0\]\.path"),
    "digest-path": (set_field("digest", "sha256:../../victim"), r"digest"),
    "sha256-path": (set_sha256("../../../victim/keep.txt"), r"files\[0\]\.sha256"),
    # the other rules
    "path-absolute": (set_path("/escaped-abs.txt"), r"files\[0\]\.path"),  # under tmp_path
    "path-backslash": (set_path("..\\..\\..\\escaped.txt"), r"files\[0\]\.path"),
    "path-nul": (set_path("a.txt\x00.sh"), r"files\[0\]\.path"),
    "path-empty": (set_path(""), r"files\[0\]\.path"),
    "path-dot-segment": (set_path("./sub/../a.txt"), r"files\[0\]\.path"),
    "path-double-slash": (set_path("sub//b.json", 1), r"files\[1\]\.path"),
    "path-duplicate": (duplicate, r"files\[1\]\.path .* twice"),
    "path-file-and-folder": (set_path("sub", 0), r"files\[0\]\.path .* folder"),
    "sha256-upper": (set_sha256("A" * 64), r"files\[0\]\.sha256"),
    "sha256-short": (set_sha256("a" * 63), r"files\[0\]\.sha256"),
    "sha256-newline": (set_sha256("a" * 64 + "\n"), r"files\[0\]\.sha256"),
    "digest-other": (other_digest, r"digest .* not the digest of the manifest's file list"),
    "name": (set_field("name", "other/name"), r"name 'other/name' is not the name"),
    "version": (set_field("version", "7"), r"version '7' is not the version"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_manifest_is_refused_and_nothing_outside_is_touched(
    store: ArtifactStore, tmp_path: Path, case: str
) -> None:
    edit, field = HOSTILE[case]
    m = published(store, tmp_path)
    if case == "path-absolute":  # an absolute path into this test's own folder
        edit = set_path(str(tmp_path / "escaped-abs.txt"))
    edit(m)
    write_raw(store, manifest_key(NAME, VERSION), json.dumps(m).encode())
    dest = tmp_path / "dest"
    skip = [store.cache_dir, dest]
    before = snapshot(tmp_path, skip)

    for read in (
        lambda: store.resolve(NAME),
        lambda: store.resolve(f"{NAME}:{VERSION}"),
        lambda: store.ls("demo"),
    ):
        with pytest.raises(InvalidManifest, match=field):
            read()
    if case not in ("name", "version"):  # those two are only wrong against their key
        # a caller holding the parsed manifest (e.g. read before) is refused by fetch too
        held = Manifest.model_validate(m)
        with pytest.raises(InvalidManifest, match=field):
            store.get(held, dest)
        with pytest.raises(InvalidManifest, match=field):
            store.verify_remote(held)

    assert snapshot(tmp_path, skip) == before  # nothing outside appeared, changed or went
    assert not dest.exists() or not any(dest.iterdir())
    artifacts = store.cache_dir / "artifacts"
    assert not artifacts.is_dir() or not any(artifacts.iterdir())  # nothing materialised


def test_a_sound_manifest_still_round_trips(store: ArtifactStore, tmp_path: Path) -> None:
    published(store, tmp_path)
    out = store.get(store.resolve(NAME), tmp_path / "dest")
    assert (out / "sub" / "b.json").read_text() == '{"x": 1}'


def test_a_manifest_that_is_not_one_names_the_field(store: ArtifactStore, tmp_path: Path) -> None:
    m = published(store, tmp_path)
    m["files"][0]["size"] = -1
    write_raw(store, manifest_key(NAME, VERSION), json.dumps(m).encode())
    with pytest.raises(InvalidManifest, match=r"files\.0\.size"):
        store.resolve(NAME)
    write_raw(store, manifest_key(NAME, VERSION), b"{not json")
    with pytest.raises(InvalidManifest, match="not JSON"):
        store.resolve(NAME)


LABEL_EDITS: dict[str, tuple[str, Any, str]] = {
    "name": ("name", "other/name", "name 'other/name' is not the key's"),
    "label": ("label", "other", "label 'other' is not the key's"),
    "seq": ("seq", 9, "seq 9 is not the key's"),
    "version": ("version", "../../x", "version .* breaks the naming rules"),
    "digest": ("digest", "sha256:../../victim", "digest .* is not a sha256 digest"),
}


@pytest.mark.parametrize("case", sorted(LABEL_EDITS))
def test_a_hostile_label_record_is_refused(store: ArtifactStore, tmp_path: Path, case: str) -> None:
    published(store, tmp_path)
    store.move_label("promoted", store.resolve(NAME))
    field, value, why = LABEL_EDITS[case]
    key = label_key(NAME, "promoted", 1)
    record = json.loads(store.backend.get_record(key))
    record[field] = value
    write_raw(store, key, json.dumps(record).encode())
    for read in (
        lambda: store.resolve(f"{NAME}@promoted"),
        lambda: store.labels("demo"),
        lambda: store.label_history(NAME, "promoted"),
    ):
        with pytest.raises(InvalidManifest, match=why):
            read()


DECLARED_EDITS: dict[str, tuple[Edit, str]] = {
    "deployment": (set_field("deployment", "other"), "deployment 'other' is not the key's"),
    "served_name": (
        lambda d: d["adapters"][0].update(served_name="../../escaped"),
        r"adapters\[0\]: invalid served adapter name",
    ),
    "ref": (lambda d: d["adapters"][0].update(ref="/etc/passwd"), r"adapters\[0\]: invalid"),
    "digest": (
        lambda d: d["adapters"][0].update(digest="sha256:../x"),
        r"adapters\[0\]\.digest",
    ),
}


@pytest.mark.parametrize("case", sorted(DECLARED_EDITS))
def test_a_hostile_declaration_is_refused(store: ArtifactStore, tmp_path: Path, case: str) -> None:
    from lorastack.store.declared import DeclaredAdapter, declare

    declare(store.backend, "smollm2", DeclaredAdapter(ref="chat/a:1", served_name="chat-a"))
    edit, why = DECLARED_EDITS[case]
    key = declaration_key("smollm2", 1)
    record = json.loads(store.backend.get_record(key))
    edit(record)
    write_raw(store, key, json.dumps(record).encode())
    with pytest.raises(InvalidManifest, match=why):
        declared_current(store.backend, "smollm2")


def test_verify_cache_never_touches_what_a_forged_cache_record_names(tmp_path: Path) -> None:
    from lorastack.store.cache import STAMP_SUFFIX, verify_cache

    cache = tmp_path / "cache"
    target = cache / "artifacts" / ("a" * 64)
    target.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    mtime = victim.stat().st_mtime_ns
    stamp = target.with_name(target.name + STAMP_SUFFIX)
    stamp.write_text(json.dumps({"../../../victim.txt": [7, 0, "b" * 64]}))
    _checked, problems = verify_cache(cache)
    assert problems and "unreadable cache record" in problems[0]
    assert victim.read_text() == "keep me" and victim.stat().st_mtime_ns == mtime
