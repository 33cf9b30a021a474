"""Labels (`NAME@LABEL`) on both backends: file:// and s3:// (moto over HTTP on loopback)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lorastack.errors import IntegrityError, InvalidName, NotFound
from lorastack.manifest import Manifest, split_ref
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, moto_endpoint: str) -> ArtifactStore:
    from lorastack_testing.s3 import s3_settings

    if request.param == "file":
        return open_store(CommonSettings(home=tmp_path / "home"))
    return open_store(s3_settings(tmp_path / "home", moto_endpoint))


def publish(store: ArtifactStore, tmp_path: Path, name: str, text: str) -> Manifest:
    folder = tmp_path / f"src-{name.replace('/', '_')}-{text}"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(text)
    return store.publish(folder, kind="adapter", name=name, service="test")


def test_a_label_resolves_to_the_version_it_was_moved_to(
    store: ArtifactStore, tmp_path: Path
) -> None:
    v1 = publish(store, tmp_path, "runs/a/adapter", "one")
    v2 = publish(store, tmp_path, "runs/a/adapter", "two")
    first = store.move_label("promoted", v1, evidence={"verdict": "improvement"})
    assert store.resolve("runs/a/adapter@promoted").ref == v1.ref
    assert store.resolve("runs/a/adapter").ref == v2.ref  # the latest is unaffected
    second = store.move_label("promoted", v2, forced=True, reason="hotfix")
    assert (first.seq, second.seq) == (1, 2)
    assert store.resolve("runs/a/adapter@promoted").digest == v2.digest
    rec = store.label("runs/a/adapter", "promoted")
    assert (rec.version, rec.forced, rec.reason, rec.kind) == ("2", True, "hotfix", "adapter")
    assert "@" in rec.by and rec.created
    history = store.label_history("runs/a/adapter", "promoted")
    assert [(r.version, r.evidence) for r in history] == [
        ("1", {"verdict": "improvement"}),
        ("2", {}),
    ]
    assert [x.ref for x in store.ls("runs")] == ["runs/a/adapter:1", "runs/a/adapter:2"]


def test_labels_are_listed_per_name_and_label(store: ArtifactStore, tmp_path: Path) -> None:
    a = publish(store, tmp_path, "runs/a/adapter", "a")
    b = publish(store, tmp_path, "runs/b/adapter", "b")
    store.move_label("promoted", a)
    store.move_label("promoted", b)
    store.move_label("candidate", b)
    store.move_label("promoted", a)
    listed = [(r.ref, r.seq) for r in store.labels()]
    assert listed == [
        ("runs/a/adapter@promoted", 2),
        ("runs/b/adapter@candidate", 1),
        ("runs/b/adapter@promoted", 1),
    ]
    assert [r.ref for r in store.labels("runs/b")] == [
        "runs/b/adapter@candidate",
        "runs/b/adapter@promoted",
    ]
    assert store.labels("other") == []


def test_an_unset_label_says_how_to_set_one(store: ArtifactStore, tmp_path: Path) -> None:
    publish(store, tmp_path, "runs/a/adapter", "a")
    with pytest.raises(NotFound) as e:
        store.resolve("runs/a/adapter@promoted")
    assert "no label runs/a/adapter@promoted" in e.value.message
    assert "lorastack promote runs/a/adapter:VERSION" in e.value.hint


def test_a_label_on_a_republished_version_is_refused(store: ArtifactStore, tmp_path: Path) -> None:
    v1 = publish(store, tmp_path, "runs/a/adapter", "one")
    store.move_label("promoted", v1)
    store.delete("runs/a/adapter", "1")
    with pytest.raises(NotFound, match="no longer in"):
        store.resolve("runs/a/adapter@promoted")
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("other bytes")
    store.publish(folder, kind="adapter", name="runs/a/adapter", service="test", version="1")
    with pytest.raises(IntegrityError, match="not the content"):
        store.resolve("runs/a/adapter@promoted")


def test_concurrent_moves_all_land_in_the_history(store: ArtifactStore, tmp_path: Path) -> None:
    versions = [publish(store, tmp_path, "runs/c/adapter", str(i)) for i in range(4)]
    threads = [threading.Thread(target=store.move_label, args=("promoted", m)) for m in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = store.label_history("runs/c/adapter", "promoted")
    assert [r.seq for r in history] == [1, 2, 3, 4]
    assert sorted(r.version for r in history) == ["1", "2", "3", "4"]


@pytest.mark.parametrize(
    "ref",
    ["a@", "a@v3", "a@1x", "a@b/c", "a:1@p", "a@p:1", "@p", "a@p@q"],
)
def test_bad_labelled_refs_say_what_to_write(ref: str) -> None:
    with pytest.raises(InvalidName) as e:
        split_ref(ref)
    assert e.value.hint


def test_refs_split_into_name_version_label() -> None:
    assert split_ref("runs/a/adapter") == ("runs/a/adapter", None, None)
    assert split_ref("runs/a/adapter:3") == ("runs/a/adapter", "3", None)
    assert split_ref("runs/a/adapter@promoted") == ("runs/a/adapter", None, "promoted")
