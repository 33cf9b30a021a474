"""`lorastack data publish FILE --name NAME`: a file the preflight passes becomes a dataset
artifact a run trains on by `dataset.ref: NAME` (the same bytes again: the same version); a
file it refuses is not published, and the report printed is `data check`'s; the name a run
publishes its own split under is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lorastack.chat_data import write_jsonl
from lorastack.cli import main
from lorastack.store import open_store
from trainer.config import build_config
from trainer.data.demo_data import make_demo
from trainer.data.splits import source_file
from trainer.settings import TrainerSettings

BASE = "smollm2-135m-instruct"


@pytest.fixture
def store_home(home: Path, embedded_model: Path) -> Path:
    from lorastack.base_model import import_folder

    import_folder(TrainerSettings(home=home), embedded_model, name=BASE)
    return home


def test_a_file_the_preflight_passes_is_published_and_trained_on_by_name(
    store_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chats = tmp_path / "chats.jsonl"
    write_jsonl(chats, make_demo(20, seed=3))
    assert main(["data", "publish", str(chats), "--name", "my-data"]) == 0
    first = capsys.readouterr().out
    assert "dataset check:" in first and "published my-data:1" in first
    assert main(["data", "publish", str(chats), "--name", "my-data"]) == 0
    assert "published my-data:1" in capsys.readouterr().out  # the same bytes, the same version

    settings = TrainerSettings()
    config = build_config({"dataset": {"ref": "my-data"}, "output": "my-run"})
    path, source = source_file(config, open_store(settings))
    assert path.read_bytes() == chats.read_bytes() and source == "my-data:1/chats.jsonl"


def test_a_file_the_preflight_refuses_is_not_published_and_says_what_data_check_says(
    store_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chats = tmp_path / "chats.jsonl"
    write_jsonl(chats, make_demo(20, seed=3))
    lines = chats.read_text().splitlines()
    broken = json.loads(lines[4])
    broken["messages"] = [m for m in broken["messages"] if m["role"] != "assistant"]
    chats.write_text("\n".join([*lines[:4], json.dumps(broken), *lines[5:]]) + "\n")
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"dataset": {"path": str(chats)}, "output": "my-run"}))

    assert main(["data", "check", str(run)]) == 3
    checked = capsys.readouterr().out
    assert main(["data", "publish", str(chats), "--name", "my-data", "--config", str(run)]) == 3
    published = capsys.readouterr().out
    assert published.startswith(checked) and "not published" in published
    assert open_store(TrainerSettings()).versions("my-data") == []


def test_the_runs_own_split_name_is_refused(
    store_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chats = tmp_path / "chats.jsonl"
    write_jsonl(chats, make_demo(5, seed=3))
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"dataset": {"ref": "whatever"}, "output": "my-run"}))
    code = main(["data", "publish", str(chats), "--name", "my-run/data", "--config", str(run)])
    assert code == 2 and "publishes its own split" in capsys.readouterr().err
