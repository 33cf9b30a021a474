"""S3 multipart limits (issue 38): a resumed upload reads every page of ListParts (S3 gives
at most 1,000 parts a page; here the page is 2 parts, against moto on loopback), and a file
that would need more than 10,000 parts at the configured size goes up in larger parts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from lorastack.errors import ConfigError
from lorastack.store.backend import blob_key
from lorastack.store.s3 import MIB, S3_MAX_PARTS, S3Backend, part_size_for

GIB, TIB = 1024 * MIB, 1024 * 1024 * MIB


@pytest.mark.parametrize(
    ("size", "wanted", "part"),
    [
        (100 * MIB, 16 * MIB, 16 * MIB),  # 7 parts: as configured
        (S3_MAX_PARTS * 16 * MIB, 16 * MIB, 16 * MIB),  # exactly 10,000 parts still fits
        (S3_MAX_PARTS * 16 * MIB + 1, 16 * MIB, 17 * MIB),  # one byte more: next whole MiB
        (1 * TIB, 16 * MIB, 105 * MIB),  # 1 TiB / 10,000 = 104.9 MiB
        (5 * TIB, 5 * MIB, 525 * MIB),  # S3's largest object: 524.3 MiB, under 5 GiB a part
    ],
)
def test_part_size_keeps_a_file_within_10000_parts(size: int, wanted: int, part: int) -> None:
    got = part_size_for(size, wanted)
    assert got == part and got % MIB == 0 and got <= 5 * GIB
    assert -(-size // got) <= S3_MAX_PARTS


def test_a_file_over_s3s_object_limit_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match="over S3's 5 TiB object limit") as e:
        part_size_for(5 * TIB + 1, 16 * MIB)
    assert "split the file" in e.value.hint


def test_a_resumed_upload_reads_every_page_of_its_parts(tmp_path: Path, moto_endpoint: str) -> None:
    from lorastack_testing.s3 import s3_settings

    settings = s3_settings(tmp_path / "home", moto_endpoint, s3_multipart_mb=5)
    bucket, _, prefix = settings.resolved_store_url.removeprefix("s3://").partition("/")
    backend = S3Backend(bucket, prefix, settings, list_page_size=2)
    part = 5 * MIB
    payload = os.urandom(4 * part + 321)  # 5 parts
    src = tmp_path / "weights.bin"
    src.write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    key = f"{prefix}/{blob_key(sha)}"
    # an earlier publish stopped after 3 parts: its upload is still open on the server
    s3: Any = backend._client
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    for n in (1, 2, 3):
        s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=n,
            Body=payload[(n - 1) * part : n * part],
        )  # fmt: skip
    sent: list[int] = []  # part numbers this publish uploads
    markers: list[object] = []  # ListParts pages asked for
    events = s3.meta.events
    events.register(
        "before-parameter-build.s3.UploadPart",
        lambda params, **kw: sent.append(params["PartNumber"]),
    )
    events.register(
        "before-parameter-build.s3.ListParts",
        lambda params, **kw: markers.append(params.get("PartNumberMarker")),
    )
    backend.put_blob(sha, src)
    assert len(markers) == 2  # parts 1-2, then 3 (after PartNumberMarker 2)
    assert sent == [4, 5]  # the three stored parts were found on both pages, not sent again
    got = tmp_path / "got"
    backend.download_blob(sha, got)
    assert hashlib.sha256(got.read_bytes()).hexdigest() == sha
