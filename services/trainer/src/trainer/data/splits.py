"""Train / validation / frozen-test splits: made once, deterministic, published.

Owns reading the source (a local JSONL or a dataset artifact), the split itself (pure:
conversations with the same prompt always land in the same split, so the test split
cannot leak into training through duplicates), the folders `<output>/data` (train,
validation, split.json) and `<output>/test` (test.jsonl), and publishing them. The
same data and seed give the same bytes, hence the same digest: a re-run reuses the
published versions instead of adding new ones.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lorastack.chat_data import Conversation, load_jsonl, write_jsonl
from lorastack.errors import ConfigError, NotFound
from lorastack.manifest import Manifest, content_digest, scan_folder, sha256_file
from lorastack.store import ArtifactStore
from trainer.config import RunConfig

_WORD = re.compile(r"[a-z0-9]+")
TRAIN, VALIDATION, TEST = 0, 1, 2  # split codes, in the order of `Splits`' fields


@dataclass
class Item:
    """One conversation of the source file, with its number in it."""

    number: int  # 1-based position in the source file (its conversation number)
    conv: Conversation


@dataclass
class Splits:
    """The source's conversations split into train, validation and test."""

    train: list[Item]
    validation: list[Item]
    test: list[Item]
    source: str
    source_sha256: str

    def counts(self) -> dict[str, int]:
        """The number of samples in train, validation and test."""
        return {
            "train": len(self.train),
            "validation": len(self.validation),
            "test": len(self.test),
        }


def normalise(text: str) -> str:
    """Lower case, letters and digits only: texts equal after this are near duplicates."""
    return " ".join(_WORD.findall(text.lower()))


def prompt_key(conv: Conversation) -> str:
    """The normalised text of everything before the last turn: what groups near-duplicates."""
    return normalise("\n".join(f"{m.role}: {m.flat_text}" for m in conv.messages[:-1]))


def split_groups(sizes: Sequence[int], validation: float, test: float, seed: int) -> list[int]:
    """Which split each prompt group goes to (TRAIN, VALIDATION or TEST), given the group
    sizes in order of first appearance: shuffle the groups with `seed`, then fill test,
    then validation, then train. Pure, and the same for a file in memory and one streamed."""
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    n = sum(sizes)
    want_test = round(n * test) if test > 0 else 0
    want_val = round(n * validation) if validation > 0 else 0
    where = [TRAIN] * len(sizes)
    filled = [0, 0, 0]
    for g in order:
        if filled[TEST] < want_test:
            where[g] = TEST
        elif filled[VALIDATION] < want_val:
            where[g] = VALIDATION
        filled[where[g]] += sizes[g]
    return where


def split_items(
    items: list[Item], validation: float, test: float, seed: int
) -> tuple[list[Item], list[Item], list[Item]]:
    """Group items by prompt (`prompt_key`), then `split_groups`."""
    groups: dict[str, list[Item]] = {}
    for it in items:
        groups.setdefault(prompt_key(it.conv), []).append(it)
    members = list(groups.values())
    out: tuple[list[Item], list[Item], list[Item]] = ([], [], [])
    for g, where in enumerate(split_groups([len(m) for m in members], validation, test, seed)):
        out[where].extend(members[g])
    train, val, tst = (sorted(s, key=lambda it: it.number) for s in out)
    return train, val, tst


def source_file(config: RunConfig, store: ArtifactStore) -> tuple[Path, str]:
    """(local JSONL file, description) of `dataset.path` or `dataset.ref`."""
    ds = config.dataset
    if ds.path is not None:
        if not ds.path.is_file():
            raise NotFound(f"dataset {ds.path} does not exist", "give the path of a JSONL file")
        return ds.path, str(ds.path)
    assert ds.ref is not None
    manifest = store.resolve(ds.ref)
    folder = store.fetch(manifest)
    names = [f.path for f in manifest.files if f.path.endswith(".jsonl")]
    chosen = ds.file or (names[0] if len(names) == 1 else None)
    if chosen is None or chosen not in names:
        raise ConfigError(
            f"dataset.ref {manifest.ref} holds {names}; cannot tell which file to train on",
            "set dataset.file to one of them",
        )
    return folder / chosen, f"{manifest.ref}/{chosen}"


def load_source(config: RunConfig, store: ArtifactStore) -> tuple[list[Conversation], Path, str]:
    """(conversations, local file, description) from `dataset.path` or `dataset.ref`."""
    path, source = source_file(config, store)
    return load_jsonl(path), path, source


def make_splits(config: RunConfig, store: ArtifactStore) -> Splits:
    """Load the source (a file or a dataset artifact) and split it by the config's
    fractions and seed; refuses a split left empty."""
    convs, path, source = load_source(config, store)
    items = [Item(i, c) for i, c in enumerate(convs, start=1)]
    sp = config.split
    train, val, test = split_items(items, sp.validation, sp.test, sp.seed)
    if not train:
        raise ConfigError(f"{source}: the training split is empty", "add samples")
    if sp.validation > 0 and not val:
        raise ConfigError(
            f"{source} has {len(items)} samples: too few for a validation split",
            "add samples or set split.validation=0",
        )
    return Splits(train, val, test, source, sha256_file(path))


def write_folders(splits: Splits, config: RunConfig, root: Path) -> tuple[Path, Path]:
    """Write `root/data` and `root/test`; their bytes depend only on data and split config."""
    data, test = root / "data", root / "test"
    data.mkdir(parents=True, exist_ok=True)
    test.mkdir(parents=True, exist_ok=True)
    write_jsonl(data / "train.jsonl", [it.conv for it in splits.train])
    write_jsonl(data / "validation.jsonl", [it.conv for it in splits.validation])
    write_jsonl(test / "test.jsonl", [it.conv for it in splits.test])
    info = {
        "source_sha256": splits.source_sha256,
        "seed": config.split.seed,
        "ratios": {"validation": config.split.validation, "test": config.split.test},
        "counts": splits.counts(),
        "numbers": {
            "train": [it.number for it in splits.train],
            "validation": [it.number for it in splits.validation],
            "test": [it.number for it in splits.test],
        },
    }
    (data / "split.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return data, test


def folder_digest(folder: Path) -> str:
    """The content digest of a folder's files (as the store computes it)."""
    return content_digest(scan_folder(folder))


def publish_once(
    store: ArtifactStore, folder: Path, name: str, metadata: dict[str, object]
) -> Manifest:
    """Publish `folder` as a dataset unless a version with the same digest exists."""
    found = store.find(name, folder_digest(folder))
    if found is not None:
        return found
    return store.publish(folder, kind="dataset", name=name, service="trainer", metadata=metadata)
