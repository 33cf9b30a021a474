"""Where an evaluation's data comes from, and what the training run already measured.

`resolve_test_set` takes a local test.jsonl or a store ref (`<run>/test[:version]`) and
returns the items with their provenance (ref and digest, or path and sha256).
`read_training_evidence` reads an adapter artifact (store ref or folder): the numbers
seen during training and on validation, from `training-complete.json` and the
`metrics/metrics-step-N.json` files, kept apart and tied to the data they came from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from lorastack.chat_data import Conversation, load_jsonl
from lorastack.errors import ConfigError, NotFound
from lorastack.manifest import Manifest, sha256_file
from lorastack.run_record import COMPLETE_FILE, step_files
from lorastack.store import ArtifactStore

TEST_FILE = "test.jsonl"
_VAL_KEY = re.compile(r"(^|_)(val|valid|validation|eval)(_|$)")


class DataSource(BaseModel):
    """One piece of data named so someone else can find the same bytes."""

    role: str  # "test", "train", "validation", "adapter"
    ref: str  # store NAME:VERSION, or a local path
    digest: str  # artifact digest (store) or sha256 of the file (local)
    note: str = ""


class TestSet(BaseModel):
    """The test conversations, where they came from, and their manifest when from the store."""

    items: list[Conversation]
    source: DataSource
    manifest: Manifest | None = None  # when it came from the store


class TrainingEvidence(BaseModel):
    """The adapter's own numbers on its training and validation data, for the report (never
    the test split)."""

    adapter: DataSource
    training: dict[str, Any] = {}  # numbers seen on the training data
    validation: dict[str, Any] = {}  # numbers on the validation split (held out, not test)
    last_step_file: str = ""  # the metrics files the latest per-step numbers came from
    train_data: DataSource | None = None
    validation_data: DataSource | None = None
    manifest: Manifest | None = None


def _is_local(spec: str) -> bool:
    return spec.endswith(".jsonl") or spec.startswith((".", "/", "~")) or Path(spec).exists()


def resolve_test_set(spec: str, store: ArtifactStore | None) -> TestSet:
    """Load the frozen test split from a file, a folder holding test.jsonl, or the store."""
    if _is_local(spec):
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / TEST_FILE
        items = load_jsonl(path)
        src = DataSource(role="test", ref=str(path.resolve()), digest="sha256:" + sha256_file(path))
        return TestSet(items=items, source=src)
    if store is None:
        raise ConfigError(
            f"{spec!r} is not a local file and no store is configured",
            "give a path to test.jsonl, or set LORASTACK_STORE_URL / LORASTACK_HOME",
        )
    manifest = store.resolve(spec)
    if manifest.kind != "dataset":
        raise ConfigError(
            f"{manifest.ref} is a {manifest.kind}, not a dataset",
            "give the frozen test split, e.g. <run>/test",
        )
    folder = store.fetch(manifest)
    if not (folder / TEST_FILE).is_file():
        raise NotFound(
            f"{manifest.ref} holds no {TEST_FILE}", "give the frozen test split, e.g. <run>/test"
        )
    items = load_jsonl(folder / TEST_FILE)
    src = DataSource(role="test", ref=manifest.ref, digest=manifest.digest)
    return TestSet(items=items, source=src, manifest=manifest)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}", "the adapter artifact looks damaged") from e
    return data if isinstance(data, dict) else {"value": data}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        elif isinstance(v, int | float | str | bool) or v is None:
            flat[key] = v
    return flat


def split_training_validation(numbers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keys naming val/validation/eval go to validation; everything else to training."""
    train: dict[str, Any] = {}
    val: dict[str, Any] = {}
    for k, v in _flatten(numbers).items():
        leaf = k.lower().replace(".", "_").replace("-", "_")
        (val if _VAL_KEY.search(leaf) else train)[k] = v
    return train, val


def _name_training_data(ev: TrainingEvidence, manifest: Manifest) -> None:
    """Name the adapter's training and validation data in `ev` from its manifest's dataset
    parent (the splits inside it are train.jsonl and validation.jsonl)."""
    for parent in manifest.parents:
        if parent.role in ("dataset", "data"):
            ref = f"{parent.name}:{parent.version}"
            ev.train_data = DataSource(
                role="train", ref=ref, digest=parent.digest, note="train.jsonl"
            )
            ev.validation_data = DataSource(
                role="validation", ref=ref, digest=parent.digest, note="validation.jsonl"
            )


def read_training_evidence(spec: str, store: ArtifactStore | None) -> TrainingEvidence:
    """Training and validation numbers of an adapter (store ref or local folder)."""
    manifest: Manifest | None = None
    path = Path(spec).expanduser()
    if path.is_dir():
        folder = path
        adapter = DataSource(role="adapter", ref=str(path.resolve()), digest="(local folder)")
    else:
        if store is None:
            raise ConfigError(f"adapter {spec!r} is not a folder and no store is configured")
        manifest = store.resolve(spec)
        folder = store.fetch(manifest)
        adapter = DataSource(role="adapter", ref=manifest.ref, digest=manifest.digest)
    complete = folder / COMPLETE_FILE
    training: dict[str, Any] = {}
    validation: dict[str, Any] = {}
    if complete.is_file():
        training, validation = split_training_validation(_load_json(complete))
    last_file = ""
    steps = step_files(folder, "metrics")  # the trainer's per-step numbers
    if steps:
        last = steps[-1]
        last_file = str(last.relative_to(folder))
        t, v = split_training_validation(_load_json(last))
        training.update({f"last_step.{k}": val for k, val in t.items()})
        validation.update({f"last_step.{k}": val for k, val in v.items()})
    evals = step_files(folder, "eval")  # the trainer's validation passes
    if evals:
        _, v = split_training_validation(_load_json(evals[-1]))
        validation.update({f"{evals[-1].stem}.{k}": val for k, val in v.items()})
        last_file += (", " if last_file else "") + str(evals[-1].relative_to(folder))
    if not training and not validation:
        raise NotFound(
            f"adapter {spec!r} holds neither training-complete.json nor metrics-step-N.json",
            "give a finished adapter artifact (<run>/adapter), or leave out --adapter",
        )
    ev = TrainingEvidence(
        adapter=adapter,
        training=training,
        validation=validation,
        last_step_file=last_file,
        manifest=manifest,
    )
    if manifest is not None and store is not None:
        _name_training_data(ev, manifest)
    return ev
