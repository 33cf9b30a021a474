"""Fault drills on the artifact store, each asserting what the user keeps.

- The S3 endpoint goes away in the middle of a multipart publish (a real S3 server,
  moto, stopped and started again on the same port): nothing is half visible, the error
  names the endpoint, and publishing again uploads only the parts that are missing.
- A file of the local cache is damaged: it is found before it is handed out (size and
  mtime against the cache record), fetched again, and `verify_cache` (`lorastack store
  verify`) finds damage that kept size and mtime.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
from moto.server import ThreadedMotoServer

from lorastack.errors import StoreUnavailable
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack.store.backend import blob_key
from lorastack.store.cache import verify_cache

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
    store.backend._client.meta.events.register(  # type: ignore[attr-defined]
        "before-parameter-build.s3.UploadPart",
        lambda params, **kw: uploaded.append(params["PartNumber"]),
    )

    def stop_after_some_parts() -> None:
        while len(uploaded) < 3:
            time.sleep(0.001)
        server.stop()  # the endpoint goes away mid-publish

    killer = threading.Thread(target=stop_after_some_parts)
    killer.start()
    try:
        with pytest.raises(StoreUnavailable) as e:
            store.publish(src, kind="checkpoint", name="run/checkpoints", service="test")
        killer.join()
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


def test_damaged_cache_file_is_caught_before_use(tmp_path: Path) -> None:
    store = open_store(CommonSettings(home=tmp_path / "home"))
    src = tmp_path / "model"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"w" * 4096)
    (src / "config.json").write_text('{"a": 1}')
    m = store.publish(src, kind="base-model", name="m", service="test")
    cached = store.fetch(m)

    # overwritten in place (size kept, mtime moves): refetched before anyone gets it
    with (cached / "weights.bin").open("r+b") as f:
        f.write(b"X")
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
