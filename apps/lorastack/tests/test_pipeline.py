"""`lorastack demo`'s inputs: the demo config comes from the trainer package itself; the
demo's earlier run is continued, or started afresh when other code left it."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest

from lorastack.store import open_store
from lorastack_app.earlier_run import continue_or_restart
from lorastack_app.pipeline import RUN, demo_config
from trainer.config import load_config
from trainer.publish.checkpoint import code_version
from trainer.readings import library_versions
from trainer.settings import TrainerSettings


def test_the_demo_config_is_package_data_of_the_trainer() -> None:
    path = demo_config()
    assert path.is_file() and path.parent.parent.name == "trainer"
    assert path.read_bytes() == (files("trainer") / "configs" / "demo.yaml").read_bytes()
    cfg = load_config(path, ["dataset.path=demo-dates.jsonl"])
    assert cfg.base_model == "smollm2-135m-instruct"


def _checkpoint(folder: Path, manifest: dict[str, Any]) -> Path:
    """A checkpoint folder as far as the demo reads it: its run manifest."""
    folder.mkdir(parents=True)
    (folder / "run-manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_demo_continues_its_own_run_and_restarts_one_other_code_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lorastack demo` passes --resume only for a run this code and config made; a run
    an older install left (other code_version, a config without a field added since) is
    cleared, its own run only, with one line saying so, and trained afresh."""
    settings = TrainerSettings(home=tmp_path / "home", store_url="", runs_dir=None)
    store, runs = open_store(settings), settings.resolved_runs_dir
    config = load_config(demo_config(), [f"dataset.path={tmp_path / 'demo-dates.jsonl'}"])
    assert continue_or_restart(store, runs, config) == []  # a first demo: a new run

    this_code = {
        "code_version": code_version(),
        "libraries": library_versions(),
        "config": config.model_dump(mode="json"),
        "dataset_digest": "sha256:" + "a" * 64,
    }
    name = f"{RUN}/checkpoints"
    store.publish(
        _checkpoint(tmp_path / "ckpt-20", this_code), kind="checkpoint", name=name,
        service="trainer", version="20",
    )  # fmt: skip
    assert continue_or_restart(store, runs, config) == ["--resume"]
    assert store.versions(name) == ["20"] and capsys.readouterr().out == ""

    # another run's checkpoints, which the demo never touches
    other = _checkpoint(runs / "other" / "checkpoints" / "step-00000005", this_code)
    store.publish(other, kind="checkpoint", name="other/checkpoints", service="trainer")
    older = {**this_code, "code_version": "trainer 0.1.0 src:0123456789abcdef"}
    older["config"] = {k: v for k, v in this_code["config"].items() if k != "report_to"}
    _checkpoint(runs / RUN / "checkpoints" / "step-00000040", older)  # newer than the store's
    (runs / RUN / "smoke").mkdir()
    assert continue_or_restart(store, runs, config) == []
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "(step 40)" in said[0] and "starting it afresh" in said[0]
    assert "code_version" in said[0] and "report_to" not in said[0]  # added at its default
    assert store.versions(name) == [] and not (runs / RUN).exists()
    assert store.versions("other/checkpoints") == ["1"] and other.is_dir()
    assert continue_or_restart(store, runs, config) == []  # now a new run


def test_a_demo_checkpoint_without_a_readable_run_manifest_is_started_afresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = TrainerSettings(home=tmp_path / "home", store_url="", runs_dir=None)
    runs = settings.resolved_runs_dir
    config = load_config(demo_config(), [f"dataset.path={tmp_path / 'demo-dates.jsonl'}"])
    step = runs / RUN / "checkpoints" / "step-00000020"
    step.mkdir(parents=True)
    (step / "run-manifest.json").write_text("{torn")
    assert continue_or_restart(open_store(settings), runs, config) == []
    assert "run-manifest.json unreadable" in capsys.readouterr().out
    assert not (runs / RUN).exists()


def test_the_command_line_starts_without_torch() -> None:
    """Every `lorastack` command (a gateway process, too) builds the parser of all of them:
    torch, 2-9 s to import, waits until a command needs it (the demo's earlier run)."""
    code = "import sys; from lorastack.cli import build_parser; build_parser();"
    code += " print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
