"""`lorastack promote` on real evidence: `lorastack eval` against the fake OpenAI server,
published to a file:// store, then the command itself (exit codes, messages, records)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from evaluation import EvalConfig, run_eval
from lorastack.cli import main as cli_main
from lorastack.manifest import Manifest
from lorastack.settings import CommonSettings
from lorastack.store import ArtifactStore, open_store
from lorastack_testing.fake_engine import publish_tiny_adapter
from lorastack_testing.fake_state import write_upper_case_task
from lorastack_testing.fake_vllm import FakeServer

# which side answers right (upper case) in the next evaluation: "lora", "base" or "both"
RIGHT = {"side": "lora"}


def _answer(model: str, prompt: str) -> str:
    side = "lora" if model == "fake-lora" else "base"
    return prompt.upper() if RIGHT["side"] in (side, "both") else prompt


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with FakeServer(
        models=[{"id": "fake-base"}, {"id": "fake-lora"}], answer=_answer, prompt_tokens=None
    ) as f:
        yield f


def _store(home: Path) -> ArtifactStore:
    return open_store(CommonSettings(home=home))


def _adapter(store: ArtifactStore, tmp_path: Path, seed: str) -> Manifest:
    return publish_tiny_adapter(store, tmp_path / f"adapter-{seed}", None, name="demo/adapter")


def _evaluate(
    fake: FakeServer,
    store: ArtifactStore,
    tmp_path: Path,
    adapter: Manifest,
    right: str,
    items: int = 12,
) -> None:
    """Publish demo/eval for `adapter`, `right` deciding which side answers correctly."""
    test = write_upper_case_task(tmp_path / f"test-{adapter.version}-{right}.jsonl", items)
    RIGHT["side"] = right
    cfg = EvalConfig(
        base_url=fake.base_url, test=str(test), base_model="fake-base", lora_model="fake-lora",
        adapter=adapter.ref, scorers=["contains", "exact"], primary_metric="exact",
        max_tokens=8, resamples=200,
    )  # fmt: skip
    run_eval(cfg, out_dir=tmp_path / f"out-{test.stem}", store=store, publish_as="demo/eval")


@pytest.mark.parametrize(
    ("right", "verdict", "numbers"),
    [
        ("base", "regression", "baseline 1.000, adapter 0.000 (difference -1.000)"),
        ("both", "uncertain", "baseline 1.000, adapter 1.000 (difference +0.000)"),
    ],
)
def test_no_improvement_is_refused_with_the_numbers(
    fake: FakeServer,
    home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    right: str,
    verdict: str,
    numbers: str,
) -> None:
    store = _store(home)
    adapter = _adapter(store, tmp_path, "a")
    _evaluate(fake, store, tmp_path, adapter, right)
    assert cli_main(["promote", "demo/adapter"]) == 3
    err = capsys.readouterr().err
    assert f"says '{verdict}' on the primary metric 'exact'" in err
    assert "demo/eval:1" in err and numbers in err and "n = 12" in err
    assert "--force --reason" in err
    assert store.labels() == []


@pytest.mark.parametrize("items", [1, 2, 5])
def test_too_few_items_are_refused_naming_the_count_and_the_minimum(
    fake: FakeServer,
    home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    items: int,
) -> None:
    # the adapter right on every item, the base on none: a percentile bootstrap alone
    # called this "improvement" on a single item; a sign test needs 6 (2 * 0.5**6 < 0.05)
    store = _store(home)
    adapter = _adapter(store, tmp_path, "a")
    _evaluate(fake, store, tmp_path, adapter, "lora", items=items)
    assert cli_main(["promote", "demo/adapter"]) == 3
    err = capsys.readouterr().err
    assert "says 'too few items' on the primary metric 'exact'" in err
    assert f"n = {items} (minimum 6)" in err
    assert f"{items} paired items are too few" in err and "fewer than 6" in err
    assert "Traceback" not in err and store.labels() == []


def test_an_older_report_without_the_exact_test_is_refused(
    fake: FakeServer, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a report.json written before the sign test was part of the rule: its "improvement"
    # rested on a percentile bootstrap alone, so promote asks for a new evaluation
    store = _store(home)
    adapter = _adapter(store, tmp_path, "a")
    _evaluate(fake, store, tmp_path, adapter, "lora")
    folder = tmp_path / "old-report"
    shutil.copytree(store.fetch(store.resolve("demo/eval:1")), folder)
    report = json.loads((folder / "report.json").read_text())
    for m in report["metrics"].values():
        for field in ("p_value", "min_items", "ci_method"):
            del m[field]
    (folder / "report.json").write_text(json.dumps(report))
    old = store.publish(
        folder, kind="report", name="demo/eval", service="evaluation",
        parents=[adapter.as_parent("adapter")],
    )  # fmt: skip
    assert cli_main(["promote", "demo/adapter", "--report", old.ref]) == 3
    err = capsys.readouterr().err
    assert "says 'no exact test'" in err and "evaluate it again" in err
    assert store.labels() == []


def test_an_improvement_is_promoted_and_resolves(
    fake: FakeServer, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(home)
    v1 = _adapter(store, tmp_path, "a")
    _evaluate(fake, store, tmp_path, v1, "lora")
    v2 = _adapter(store, tmp_path, "b")
    _evaluate(fake, store, tmp_path, v2, "both")  # newer, and for another version
    assert cli_main(["promote", "demo/adapter:1"]) == 0
    out = capsys.readouterr().out
    assert "demo/adapter@promoted -> demo/adapter:1" in out
    assert "evidence: demo/eval:1: exact: baseline 0.000, adapter 1.000" in out
    assert "served as demo/adapter-promoted" in out
    assert store.resolve("demo/adapter@promoted").ref == "demo/adapter:1"
    rec = store.label("demo/adapter", "promoted")
    assert not rec.forced and rec.evidence["verdict"] == "improvement"
    assert rec.evidence["report"] == "demo/eval:1" and rec.evidence["ci_low"] > 0
    # v2's own evaluation (uncertain) decides for v2, not v1's
    assert cli_main(["promote", "demo/adapter:2"]) == 3
    assert store.resolve("demo/adapter@promoted").ref == "demo/adapter:1"
    capsys.readouterr()
    assert cli_main(["promote", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "demo/adapter@promoted" in listed and "exact improvement in demo/eval:1" in listed
    assert cli_main(["store", "ls", "demo"]) == 0
    assert "demo/adapter@promoted" in capsys.readouterr().out


def test_force_records_the_reason_and_who(
    fake: FakeServer, home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(home)
    adapter = _adapter(store, tmp_path, "a")
    assert cli_main(["promote", "demo/adapter", "--force"]) == 2
    assert "--force needs --reason" in capsys.readouterr().err
    # no evaluation at all: refused, saying how to make one
    assert cli_main(["promote", "demo/adapter"]) == 2
    assert f"--adapter {adapter.ref}" in capsys.readouterr().err
    _evaluate(fake, store, tmp_path, adapter, "base")
    assert cli_main(["promote", "demo/adapter", "--force", "--reason", "rollback of #31"]) == 0
    assert "FORCED: rollback of #31" in capsys.readouterr().out
    rec = store.label("demo/adapter", "promoted")
    assert rec.forced and rec.reason == "rollback of #31" and "@" in rec.by and rec.created
    assert rec.evidence["verdict"] == "regression"  # what it was forced over


def test_bad_targets_say_what_to_give(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(home)
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("{}\n")
    store.publish(folder, kind="dataset", name="demo/data", service="test")
    assert cli_main(["promote", "demo/data"]) == 2
    assert "is a dataset, not an adapter" in capsys.readouterr().err
    assert cli_main(["promote", "demo/adapter@promoted"]) == 2
    assert "promote a version, not a label" in capsys.readouterr().err
    assert cli_main(["promote"]) == 2
    assert "name the adapter to promote" in capsys.readouterr().err


def test_primary_metric_defaults_to_the_first_scorer_and_must_be_one(tmp_path: Path) -> None:
    from evaluation.eval_config import load_eval_config
    from lorastack.errors import ConfigError

    base = {"base_url": "http://x", "test": "t.jsonl", "base_model": "b", "lora_model": "l"}
    assert load_eval_config(None, {**base, "scorers": ["contains", "exact"]}).primary_metric == (
        "contains"
    )
    with pytest.raises(ConfigError, match="primary_metric 'bleu' is not one of the scorers"):
        load_eval_config(None, {**base, "primary_metric": "bleu"})
