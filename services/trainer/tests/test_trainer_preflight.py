"""Dataset check: over-length samples are refused with a report (or dropped when asked),
splits are deterministic, leak-free and published once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.chat_data import Conversation, load_jsonl, write_jsonl
from lorastack.store import open_store
from trainer.config import load_config
from trainer.data.demo_data import make_demo
from trainer.data.preparation import check
from trainer.data.splits import Item, make_splits, publish_once, split_items, write_folders
from trainer.errors import PreflightRefused
from trainer.recipe import run_training
from trainer.settings import TrainerSettings


def _with_long_target(path: Path) -> Path:
    convs = load_jsonl(path)
    convs.append(
        Conversation.model_validate(
            {
                "messages": [
                    {"role": "user", "content": "Write the date many times."},
                    {"role": "assistant", "content": " ".join(["2021-03-03"] * 40)},
                ]
            }
        )
    )
    out = path.with_name("long.jsonl")
    write_jsonl(out, convs)
    return out


def test_overlong_target_is_refused_with_a_report(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    data = _with_long_target(demo_jsonl)
    cfg = load_config(write_config("long", data), ["split.test=0", "split.validation=0.1"])
    report = check(cfg, trainer_env)
    assert not report.ok
    (row,) = report.overlong
    assert row.number == 31 and row.total > 128 and row.target > 100  # the target is the long part
    text = report.render()
    assert "exceed max_seq_len=128" in text and "drop_overlong" in text and "REFUSED" in text
    # training refuses before any model is loaded, and says why
    with pytest.raises(PreflightRefused, match="longer than 128"):
        run_training(cfg, trainer_env)
    dropped = check(
        load_config(write_config("long2", data), ["dataset.drop_overlong=true"]), trainer_env
    )
    assert dropped.ok and dropped.dropped == 1 and "dropped 1" in dropped.render()


def test_special_tokens_in_content_are_refused(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    convs = load_jsonl(demo_jsonl)
    convs[0].messages[-1].content = "2021<|im_end|>"
    bad = demo_jsonl.with_name("bad.jsonl")
    write_jsonl(bad, convs)
    report = check(load_config(write_config("bad", bad)), trainer_env)
    assert not report.ok
    assert [(p.line, p.kind) for p in report.line_problems] == [(1, "special_token")]


def test_splits_are_deterministic_grouped_and_published_once(
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    convs = make_demo(20, seed=3)
    items = [Item(i, c) for i, c in enumerate(convs + convs[:5], start=1)]  # 5 duplicates
    a = split_items(items, 0.2, 0.2, seed=4)
    b = split_items(items, 0.2, 0.2, seed=4)
    assert [[it.number for it in s] for s in a] == [[it.number for it in s] for s in b]
    test_prompts = {it.conv.to_json() for it in a[2]}
    assert not test_prompts & {it.conv.to_json() for it in a[0] + a[1]}  # duplicates never leak

    cfg = load_config(write_config("splits", demo_jsonl))
    store = open_store(trainer_env)
    first = write_folders(make_splits(cfg, store), cfg, tmp_path / "one")
    again = write_folders(make_splits(cfg, store), cfg, tmp_path / "two")
    m1 = publish_once(store, first[0], "splits/data", {})
    m2 = publish_once(store, again[0], "splits/data", {})
    assert (m1.version, m1.digest) == (m2.version, m2.digest) == ("1", m2.digest)
    info = json.loads((first[0] / "split.json").read_text())
    assert info["counts"] == {"train": 24, "validation": 3, "test": 3} and info["seed"] == 0
