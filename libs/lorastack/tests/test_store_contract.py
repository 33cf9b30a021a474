"""The artifact store's contract, run against both backends: file:// and s3:// (a real
S3 server on 127.0.0.1, moto, over HTTP)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from lorastack.errors import Conflict, IntegrityError, InvalidName, NotFound, StoreUnavailable
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store
from lorastack.store.backend import blob_key


def make_settings(kind: str, tmp_path: Path, endpoint: str) -> CommonSettings:
    from lorastack_testing.s3 import s3_settings

    if kind == "file":
        return CommonSettings(home=tmp_path / "home")
    return s3_settings(tmp_path / "home", endpoint)


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, moto_endpoint: str) -> ArtifactStore:
    return open_store(make_settings(request.param, tmp_path, moto_endpoint))


def small_folder(root: Path, text: str = "hello") -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(text)
    (root / "sub" / "b.json").write_text('{"x": 1}')
    return root


def corrupt_blob(store: ArtifactStore, sha256: str) -> None:
    """Flip one byte of a stored object, behind the store's back."""
    backend = store.backend
    if store.url.startswith("file://"):
        path = Path(store.url.removeprefix("file://")) / blob_key(sha256)
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    client = backend._client  # type: ignore[attr-defined]
    key = backend._key(blob_key(sha256))  # type: ignore[attr-defined]
    bucket = backend.bucket  # type: ignore[attr-defined]
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[0] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_round_trip_with_a_multipart_file(store: ArtifactStore, tmp_path: Path) -> None:
    src = small_folder(tmp_path / "src")
    big = src / "weights.bin"
    chunk = os.urandom(1 << 20)
    with big.open("wb") as f:
        for i in range(65):  # 65 MiB: several parts at the 16 MiB multipart size
            f.write(bytes([i]) + chunk[1:])
    m = store.publish(src, kind="base-model", name="demo/base", service="test", config={"a": 1})
    assert m.version == "1" and len(m.files) == 3
    assert store.manifest("demo/base").digest == m.digest
    out = store.get(m, tmp_path / "out")
    assert (
        hashlib.sha256(big.read_bytes()).digest()
        == hashlib.sha256((out / "weights.bin").read_bytes()).digest()
    )
    assert (out / "sub" / "b.json").read_text() == '{"x": 1}'
    assert [x.ref for x in store.ls("demo")] == ["demo/base:1"]


def test_versions_increase_and_latest_wins(store: ArtifactStore, tmp_path: Path) -> None:
    for i in range(3):
        store.publish(
            small_folder(tmp_path / f"v{i}", f"t{i}"), kind="dataset", name="ds", service="test"
        )
    assert store.versions("ds") == ["1", "2", "3"]
    assert store.resolve("ds").version == "3"
    assert store.resolve("ds:2").version == "2"
    with pytest.raises(NotFound):
        store.resolve("ds:9")
    with pytest.raises(NotFound, match="no artifact named"):
        store.resolve("nothing")


def test_flipped_byte_is_caught_and_not_cached(store: ArtifactStore, tmp_path: Path) -> None:
    m = store.publish(small_folder(tmp_path / "src"), kind="report", name="r", service="test")
    entry = next(f for f in m.files if f.path == "a.txt")
    corrupt_blob(store, entry.sha256)
    with pytest.raises(IntegrityError, match=r"a\.txt is corrupted"):
        store.fetch(m)
    cache = store.cache_dir
    assert not (cache / "blobs" / entry.sha256).exists()
    assert not list((cache / "blobs").glob(".tmp-*"))
    assert not (cache / "artifacts" / m.digest.removeprefix("sha256:")).exists()


def test_concurrent_publishes_of_one_version_one_wins(store: ArtifactStore, tmp_path: Path) -> None:
    folders = [small_folder(tmp_path / f"w{i}", f"writer {i}") for i in range(2)]
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def publish(i: int) -> None:
        barrier.wait()
        try:
            results[i] = store.publish(
                folders[i], kind="adapter", name="ad", version="7", service="test"
            )
        except Conflict as e:
            results[i] = e

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conflicts = [r for r in results if isinstance(r, Conflict)]
    assert len(conflicts) == 1, results
    winner = next(r for r in results if not isinstance(r, Conflict))
    fetched = store.fetch(store.resolve("ad:7"))
    assert store.resolve("ad:7").digest == winner.digest  # type: ignore[attr-defined]
    assert (fetched / "a.txt").read_text() in ("writer 0", "writer 1")


class FailingBackend:
    """Delegates to a real backend but breaks on the n-th blob upload."""

    def __init__(self, inner: object, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.url = inner.url  # type: ignore[attr-defined]

    def put_blob(self, sha256: str, src: Path) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("network cut half way")
        self.inner.put_blob(sha256, src)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_failed_upload_leaves_nothing_visible(store: ArtifactStore, tmp_path: Path) -> None:
    broken = ArtifactStore(FailingBackend(store.backend, fail_at=2), store.cache_dir)  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        broken.publish(small_folder(tmp_path / "src"), kind="checkpoint", name="ck", service="test")
    assert store.ls() == []
    assert store.versions("ck") == []


@pytest.mark.parametrize("bad", ["../x", "/abs", "a//b", "a/../b", "", "a/./b", "x y", ".hidden"])
def test_traversal_and_bad_names_refused(store: ArtifactStore, tmp_path: Path, bad: str) -> None:
    with pytest.raises(InvalidName):
        store.publish(small_folder(tmp_path / "src"), kind="report", name=bad, service="test")
    with pytest.raises(InvalidName):
        store.resolve(bad or ":1")


def test_unreachable_s3_is_retried_then_explained(tmp_path: Path) -> None:
    from lorastack_testing.net import free_port

    settings = CommonSettings(
        home=tmp_path,
        store_url="s3://nobody",
        s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
        s3_access_key_id="x",
        s3_secret_access_key="x",
        s3_max_attempts=2,  # type: ignore[arg-type]
    )
    with pytest.raises(StoreUnavailable, match="failed 2 times"):
        open_store(settings).ls()
