"""Fault drills on the artifact store, each asserting what the user keeps.

- The S3 endpoint goes away in the middle of a multipart publish (a real S3 server,
  moto, stopped and started again on the same port): nothing is half visible, the error
  names the endpoint, and publishing again uploads only the parts that are missing.
- A file of the local cache is damaged: it is found before it is handed out (size and
  mtime against the cache record), fetched again, and `verify_cache` (`lorastack store
  verify`) finds damage that kept size and mtime.
- A large file from a store on the same disk is a hard link to the store's read-only
  blob, not a copy; written to anyway (root ignores the mode), it is refused with the
  store's IntegrityError on every later fetch, never handed out.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from moto.server import ThreadedMotoServer

from lorastack.errors import IntegrityError, StoreUnavailable
from lorastack.manifest import Manifest
from lorastack.settings import CommonSettings
from lorastack.store import artifacts, open_store
from lorastack.store.artifacts import ArtifactStore
from lorastack.store.backend import blob_key
from lorastack.store.cache import verify_cache
from lorastack.store.local import STORED_MTIME_NS, LocalBackend

PART_MB = 5  # the smallest part S3 accepts


def test_s3_down_mid_publish_then_resume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from lorastack_testing.net import free_port
    from lorastack_testing.s3 import s3_settings

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    settings: CommonSettings = s3_settings(tmp_path / "home", endpoint, s3_multipart_mb=PART_MB)
    bucket = settings.resolved_store_url.removeprefix("s3://").split("/")[0]
    store = open_store(settings)
    s3 = store.backend._client  # type: ignore[attr-defined]
    src = tmp_path / "ckpt"
    src.mkdir()
    payload = os.urandom(12 * PART_MB * 1024 * 1024 + 123)  # 13 parts
    (src / "weights.bin").write_bytes(payload)
    (src / "config.json").write_text("{}")
    import hashlib

    key = f"team/{blob_key(hashlib.sha256(payload).hexdigest())}"
    uploaded: list[int] = []  # part numbers sent, both attempts
    down = server

    def count_then_stop(params: dict[str, int], **kw: object) -> None:
        uploaded.append(params["PartNumber"])
        if len(uploaded) == 3:  # the endpoint goes away mid-publish: before the third part
            down.stop()  # (decided here, not by a polling thread a loaded machine may starve)

    store.backend._client.meta.events.register(  # type: ignore[attr-defined]
        "before-parameter-build.s3.UploadPart", count_then_stop
    )
    try:
        with pytest.raises(StoreUnavailable) as e:
            store.publish(src, kind="checkpoint", name="run/checkpoints", service="test")
        assert endpoint in e.value.message and "resumes" in e.value.hint
        first = len(uploaded)
        assert 3 <= first < 13

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # back, same state
        # nothing half visible: no version, no blob object (an unfinished upload is none)
        assert store.versions("run/checkpoints") == []
        with pytest.raises(s3.exceptions.ClientError):
            s3.head_object(Bucket=bucket, Key=key)
        stored = s3.list_parts(Bucket=bucket, Key=key, UploadId=_upload_id(s3, bucket, key))
        kept = [p["PartNumber"] for p in stored.get("Parts", [])]
        assert kept  # the parts that made it before the endpoint went away

        with caplog.at_level(logging.INFO, logger="lorastack.store.s3"):
            m = store.publish(src, kind="checkpoint", name="run/checkpoints", service="test")
        again = uploaded[first:]
        assert sorted(again) == sorted(set(range(1, 14)) - set(kept))  # only what was missing
        assert f"{len(kept)} of 13 parts stored" in caplog.text
        assert store.versions("run/checkpoints") == [m.version]
        fetched = open_store(settings.model_copy(update={"home": tmp_path / "other"})).fetch(m)
        assert (fetched / "weights.bin").read_bytes() == payload
    finally:
        server.stop()


def _upload_id(s3: object, bucket: str, key: str) -> str:
    uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=key)["Uploads"]  # type: ignore[attr-defined]
    (one,) = [u for u in uploads if u["Key"] == key]
    return str(one["UploadId"])


def _published_model(tmp_path: Path) -> tuple[ArtifactStore, Path, Manifest]:
    """A local store holding a model folder of a 4 KB weights file and a config."""
    store = open_store(CommonSettings(home=tmp_path / "home"))
    src = tmp_path / "model"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"w" * 4096)
    (src / "config.json").write_text('{"a": 1}')
    return store, src, store.publish(src, kind="base-model", name="m", service="test")


def test_damaged_cache_file_is_caught_before_use(tmp_path: Path) -> None:
    store, _, m = _published_model(tmp_path)
    cached = store.fetch(m)

    # overwritten in place (size kept, mtime moves): refetched before anyone gets it
    weights = cached / "weights.bin"
    before = weights.stat()
    with weights.open("r+b") as f:
        f.write(b"X")
    # the test moves the mtime: a write within the file system's clock tick of the fetch's
    # own (coarse, a few ms) keeps it, and the damage then looks like bit rot
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    again = store.fetch(m)
    assert (again / "weights.bin").read_bytes() == b"w" * 4096

    # truncated: the same
    (again / "config.json").write_text("")
    assert (store.fetch(m) / "config.json").read_text() == '{"a": 1}'

    # bit rot that keeps size and mtime slips past the cheap check; verify finds it
    target = store.fetch(m) / "weights.bin"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    checked, problems = verify_cache(store.cache_dir)
    assert checked >= 4 and len(problems) == 2, problems  # the artifact and its blob
    assert any("weights.bin" in p for p in problems)
    assert verify_cache(store.cache_dir)[1] == []  # removed: clean now
    assert (store.fetch(m) / "weights.bin").read_bytes() == b"w" * 4096  # fetched again


def test_a_local_store_is_linked_not_copied_and_a_write_through_the_link_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifacts, "LINK_MIN_BYTES", 1024)
    store, src, m = _published_model(tmp_path)
    sha = {f.path: f.sha256 for f in m.files}
    stored = store.backend.blob_path(sha["weights.bin"])  # type: ignore[attr-defined]
    cached = store.fetch(m)

    assert (cached / "weights.bin").stat().st_ino == stored.stat().st_ino  # once on disk
    assert stored.stat().st_mode & 0o222 == 0  # read-only
    config_blob = store.backend.blob_path(sha["config.json"])  # type: ignore[attr-defined]
    assert (cached / "config.json").stat().st_ino != config_blob.stat().st_ino  # small: a copy
    got = store.get(m, tmp_path / "copy")
    assert (got / "weights.bin").stat().st_mode & 0o200  # `store get` gives plain files

    # written through the link anyway: the store's blob is damaged, and no fetch from this
    # cache or a fresh one hands it out
    os.chmod(cached / "weights.bin", 0o644)
    with (cached / "weights.bin").open("r+b") as f:
        f.write(b"X")
    with pytest.raises(IntegrityError, match=r"weights\.bin"):
        store.fetch(m)
    with pytest.raises(IntegrityError, match=r"weights\.bin"):
        ArtifactStore(store.backend, tmp_path / "other-cache").fetch(m)

    # damage that kept size and mtime: `store verify` finds it and marks the blob changed,
    # so the next fetch verifies instead of linking it again
    (src / "weights.bin").write_bytes(b"v" * 4096)
    m2 = store.publish(src, kind="base-model", name="m2", service="test")
    sha2 = {f.path: f.sha256 for f in m2.files}["weights.bin"]
    blob = store.backend.blob_path(sha2)  # type: ignore[attr-defined]
    fetched = store.fetch(m2)
    st = blob.stat()
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[7] ^= 0x01
    blob.write_bytes(bytes(data))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (fetched / "weights.bin").read_bytes() == bytes(data)  # slips past the cheap check
    assert any("weights.bin" in p for p in verify_cache(store.cache_dir)[1])
    with pytest.raises(IntegrityError, match=r"weights\.bin"):
        store.fetch(m2)


def test_a_handed_over_folder_is_linked_in_once_and_a_write_to_it_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifacts, "LINK_MIN_BYTES", 1024)
    store = open_store(CommonSettings(home=tmp_path / "home"))
    src = tmp_path / "merged"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"w" * 4096)
    (src / "config.json").write_text('{"a": 1}')
    m = store.publish(src, kind="base-model", name="m", service="test", hand_over=True)
    sha = {f.path: f.sha256 for f in m.files}
    stored = store.backend.blob_path(sha["weights.bin"])  # type: ignore[attr-defined]

    # the large file is the blob (one inode, no copy), read-only; the small one a copy
    assert (src / "weights.bin").stat().st_ino == stored.stat().st_ino
    assert stored.stat().st_mode & 0o222 == 0
    config_blob = store.backend.blob_path(sha["config.json"])  # type: ignore[attr-defined]
    assert (src / "config.json").stat().st_ino != config_blob.stat().st_ino
    assert (store.fetch(m) / "weights.bin").read_bytes() == b"w" * 4096

    # the publisher writes to its folder afterwards anyway: no fetch hands the change out
    os.chmod(src / "weights.bin", 0o644)
    with (src / "weights.bin").open("r+b") as f:
        f.write(b"X")
    with pytest.raises(IntegrityError, match=r"weights\.bin"):
        ArtifactStore(store.backend, tmp_path / "other-cache").fetch(m)


def test_a_folder_not_handed_over_is_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifacts, "LINK_MIN_BYTES", 1024)
    store, src, m = _published_model(tmp_path)  # a user's folder: plain publish
    stored = store.backend.blob_path(m.files[1].sha256)  # type: ignore[attr-defined]
    weights = (src / "weights.bin").stat()
    assert weights.st_ino != stored.stat().st_ino
    assert weights.st_mode & 0o200 and weights.st_mtime_ns != STORED_MTIME_NS


class _WrittenBeforeTheLink(LocalBackend):
    """A publisher's writer that gets in between the hash and the link."""

    def adopt_blob(self, sha256: str, src: Path, size: int) -> bool:
        os.chmod(src, 0o644)
        with src.open("r+b") as f:
            f.write(b"X")
        return super().adopt_blob(sha256, src, size)


def test_a_file_written_between_its_hash_and_its_link_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifacts, "LINK_MIN_BYTES", 1024)
    root = tmp_path / "store"
    store = ArtifactStore(_WrittenBeforeTheLink(root), tmp_path / "cache")
    src = tmp_path / "merged"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"w" * 4096)
    with pytest.raises(IntegrityError, match=r"weights\.bin was written to"):
        store.publish(src, kind="base-model", name="m", service="test", hand_over=True)
    assert store.versions("m") == []  # no manifest
    assert not (root / "blobs").exists() or not any((root / "blobs").rglob("*"))
