"""`lorastack data check`: every problem of every line in one run, duplicate groups with
their line numbers, a --json report, exit codes 0 / 1 (warnings) / 3 (refused), no
library noise; the streamed split is the one training uses."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from lorastack.chat_data import load_jsonl
from lorastack.store import open_store
from trainer.config import load_config
from trainer.data.preparation import check
from trainer.data.splits import make_splits
from trainer.settings import TrainerSettings

CLI = [sys.executable, "-m", "lorastack.cli"]


def _conv(user: str, answer: str) -> str:
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": msgs}, ensure_ascii=False)


def _messy(demo: Path) -> tuple[Path, dict[str, int]]:
    """The demo data with one of each problem appended; returns the file and the line of each."""
    lines = demo.read_text().splitlines()
    first = json.loads(lines[0])["messages"]
    second = json.loads(lines[1])["messages"]
    extra = {
        "not_json": '{"messages": [',
        "schema": json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        "surrogate": '{"messages": [{"role": "user", "content": "a\\ud800"}, '
        '{"role": "assistant", "content": "b"}]}',
        "deep": '{"messages": ' + "[" * 100 + "]" * 100 + "}",
        "special": _conv("What is <|im_start|> for?", "2020-01-01"),
        "overlong": _conv("Write the date many times.", " ".join(["2021-03-03"] * 60)),
        "huge": _conv("Write it a thousand times.", " ".join(["2021-03-03"] * 3000)),
        "exact": lines[0],
        "near": json.dumps(
            {"messages": [{**m, "content": m["content"].upper() + "!"} for m in second]}
        ),
    }
    assert first != second
    at, out = {}, [*lines, ""]  # a blank line is skipped, not a problem
    for kind, text in extra.items():
        out.append(text)
        at[kind] = len(out)
    path = demo.with_name("messy.jsonl")
    path.write_text("\n".join(out) + "\n")
    return path, at


def test_one_pass_reports_every_problem_with_its_line(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    path, at = _messy(demo_jsonl)
    cfg_path = write_config("messy", path)
    proc = subprocess.run(
        [*CLI, "data", "check", str(cfg_path), "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["verdict"] == "refused"
    by_line = {p["line"]: p for p in report["line_problems"]}
    assert by_line[at["not_json"]]["kind"] == "schema"
    assert "not valid JSON" in by_line[at["not_json"]]["message"]
    assert "last message must be the assistant" in by_line[at["schema"]]["message"]
    assert "lone UTF-16 surrogate" in by_line[at["surrogate"]]["message"]
    assert "more than 64 deep" in by_line[at["deep"]]["message"]
    assert by_line[at["special"]]["kind"] == "special_token"
    assert "<|im_start|>" in by_line[at["special"]]["message"]
    assert set(by_line) == {at[k] for k in ("not_json", "schema", "surrogate", "deep", "special")}
    # the lines that parse are checked too, in the same run
    overlong = {row["number"] for row in report["overlong"]} | {
        int(w.split()[1]) for w in report["warnings"] if "(test) has" in w
    }
    assert {at["overlong"], at["huge"]} <= overlong
    assert [1, at["exact"]] in report["duplicate_groups"]
    assert [2, at["near"]] in report["near_duplicate_groups"]
    assert (
        report["lines"] == at["near"] and report["conversations"] == at["near"] - 5
    )  # blank, 4 bad
    # no library noise: the transformers warning about the 3,000-date sample stays out
    assert "Token indices sequence length" not in proc.stdout + proc.stderr
    assert proc.stderr.strip() == ""

    # the table says the same, with line numbers
    text = check(load_config(cfg_path), trainer_env).render()
    assert f"line {at['deep']}: schema:" in text and "REFUSED" in text
    assert f"exact duplicates: lines 1, {at['exact']}" in text


def test_exit_codes_tell_warnings_from_refusals(
    trainer_env: TrainerSettings, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    clean = check(load_config(write_config("clean", demo_jsonl)), trainer_env)
    assert clean.verdict == "ok" and clean.exit_code == 0, clean.render()
    lines = demo_jsonl.read_text().splitlines()
    dup = demo_jsonl.with_name("dup.jsonl")
    dup.write_text("\n".join([*lines, lines[4]]) + "\n")
    warned = check(load_config(write_config("dup", dup)), trainer_env)
    assert warned.verdict == "warnings" and warned.exit_code == 1, warned.render()
    assert warned.duplicate_groups == [[5, len(lines) + 1]]


def test_streamed_split_is_the_split_training_uses(
    trainer_env: TrainerSettings, tmp_path: Path, write_config: Callable[..., Path]
) -> None:
    from lorastack.chat_data import write_jsonl
    from trainer.data.demo_data import make_demo

    data = tmp_path / "many.jsonl"
    convs = make_demo(120, seed=7)
    write_jsonl(data, convs + convs[:10])  # repeated prompts: groups of two
    cfg = load_config(write_config("many", data), ["split.validation=0.2", "split.test=0.15"])
    report = check(cfg, trainer_env)
    splits = make_splits(cfg, open_store(trainer_env))
    assert report.counts == splits.counts()
    assert len(load_jsonl(data)) == report.conversations == 130
