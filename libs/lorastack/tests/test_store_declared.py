"""Declared adapters (`deployments/NAME/adapters/<seq>.json`) on both backends: file://
and s3:// (moto over HTTP on loopback). The record in force is the highest seq; a change
that changes nothing writes nothing; concurrent changes all land."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from lorastack.errors import IntegrityError, InvalidName
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, declared, open_store
from lorastack.store.declared import DeclaredAdapter


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, moto_endpoint: str) -> ArtifactStore:
    from lorastack_testing.s3 import s3_settings

    if request.param == "file":
        return open_store(CommonSettings(home=tmp_path / "home"))
    return open_store(s3_settings(tmp_path / "home", moto_endpoint))


def entry(n: int) -> DeclaredAdapter:
    return DeclaredAdapter(ref=f"chat/adapter:{n}", served_name=f"chat/adapter-v{n}")


def test_declare_and_withdraw_keep_the_history(store: ArtifactStore) -> None:
    b = store.backend
    assert declared.current(b, "chat").seq == 0 and declared.current(b, "chat").adapters == []
    first = declared.declare(b, "chat", entry(1))
    second = declared.declare(b, "chat", entry(2))
    assert (first.seq, second.seq) == (1, 2)
    assert declared.current(b, "chat").served_names() == ["chat/adapter-v1", "chat/adapter-v2"]
    assert declared.declare(b, "chat", entry(1)).seq == 2  # already declared: nothing written
    assert declared.withdraw(b, "chat", "chat/nothing-v1").seq == 2
    gone = declared.withdraw(b, "chat", "chat/adapter-v1")
    assert gone.seq == 3 and gone.change == "withdraw chat/adapter-v1" and "@" in gone.by
    assert declared.current(b, "chat").served_names() == ["chat/adapter-v2"]
    assert declared.current(b, "other").adapters == []  # deployments are apart
    declared.declare(b, "team/other", entry(7))
    assert {(d.deployment, d.seq) for d in declared.all_current(b)} == {
        ("chat", 3),
        ("team/other", 1),
    }


def test_concurrent_changes_all_land(store: ArtifactStore) -> None:
    b = store.backend
    threads = [
        threading.Thread(target=declared.declare, args=(b, "chat", entry(n))) for n in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    now = declared.current(b, "chat")
    assert sorted(now.served_names()) == sorted(entry(n).served_name for n in range(6))
    assert now.seq == 6


def test_a_bad_deployment_name_is_refused(store: ArtifactStore) -> None:
    with pytest.raises(InvalidName, match="deployment name"):
        declared.current(store.backend, "../x")


def test_a_damaged_record_is_named_with_what_to_do(store: ArtifactStore) -> None:
    declared.declare(store.backend, "chat", entry(1))
    store.backend.put_record(declared.declaration_key("chat", 2), b"{not json")
    with pytest.raises(IntegrityError, match=r"00000002\.json") as e:
        declared.current(store.backend, "chat")
    assert "remove that record" in e.value.hint


def test_one_of_the_racing_conditional_writes_creates_the_key(moto_endpoint: str) -> None:
    """What the declarations' numbering stands on (S3's If-None-Match: * is atomic), held by
    the tests' S3 server too (lorastack_testing.s3: moto checked and stored in two steps, and
    under load two racing declarations both got 200 for one number)."""
    import boto3
    from botocore.exceptions import ClientError

    def client() -> Any:
        return boto3.client(
            "s3",
            endpoint_url=moto_endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    client().create_bucket(Bucket="racing-writes")
    writers = [client() for _ in range(8)]

    def put(s3: Any, key: str, n: int, start: threading.Barrier, created: list[int]) -> None:
        start.wait()
        try:
            s3.put_object(Bucket="racing-writes", Key=key, Body=b"%d" % n, IfNoneMatch="*")
            created.append(n)
        except ClientError as e:
            assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 412

    for round_ in range(10):
        created: list[int] = []
        start = threading.Barrier(len(writers))
        threads = [
            threading.Thread(target=put, args=(s3, f"k{round_}", n, start, created))
            for n, s3 in enumerate(writers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(created) == 1, (round_, created)
