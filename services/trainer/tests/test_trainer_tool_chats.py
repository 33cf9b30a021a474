"""Tool-calling data end to end, short of training: `data make-demo --tools` writes a
deterministic task; `data check` names the line of every badly tied call (a template
without tool support is refused per sample: test_trainer_masking); `data inspect` marks
the calls and answers as supervised and the tool results as context; the tool demo's
config loads and its template travels with the saved tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastack.chat_data import load_jsonl
from lorastack.cli import main
from lorastack.errors import NotFound
from trainer.config import load_config
from trainer.data.chat_templates import (
    apply_choice,
    chat_format_record,
    supports_tools,
    template_text,
)
from trainer.data.preparation import check
from trainer.settings import TrainerSettings


@pytest.fixture
def tools_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "tools.jsonl"
    assert main(["data", "make-demo", str(path), "--tools", "--n", "24", "--seed", "2"]) == 0
    assert "chat_template: chatml-tools" in capsys.readouterr().out
    return path


def test_make_demo_tools_is_deterministic_and_valid(tools_jsonl: Path) -> None:
    again = tools_jsonl.with_name("again.jsonl")
    assert main(["data", "make-demo", str(again), "--tools", "--n", "24", "--seed", "2"]) == 0
    assert again.read_bytes() == tools_jsonl.read_bytes()
    convs = load_jsonl(tools_jsonl)  # every call tied right, arguments JSON objects
    assert len(convs) == 24 and len({c.to_json() for c in convs}) == 24
    last_calls = [c.messages[-1].tool_calls for c in convs]
    names = {calls[0].function.name for calls in last_calls if calls}
    assert names == {"get_weather", "calculate"}  # the last call needs choosing


def test_check_names_the_line_of_every_badly_tied_call(
    trainer_env: TrainerSettings, tools_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    lines = tools_jsonl.read_text().splitlines()
    bad = json.loads(lines[0])
    bad["messages"][2]["tool_calls"][0]["function"]["name"] = "get_time"
    unanswered = json.loads(lines[1])
    del unanswered["messages"][3]  # the tool result of the first call
    messy = tools_jsonl.with_name("messy.jsonl")
    messy.write_text("\n".join([*lines, json.dumps(bad), json.dumps(unanswered)]) + "\n")

    cfg = write_config("shipped", messy, max_seq_len=1024, chat_template="chatml-tools")
    report = check(load_config(cfg), trainer_env)
    by_line = {p.line: p.message for p in report.line_problems}
    assert set(by_line) == {25, 26}, by_line
    assert "messages.2.tool_calls.0.function.name: 'get_time' is not in tools" in by_line[25]
    assert "call_" in by_line[26] and "is never answered by a tool message" in by_line[26]
    assert report.counts["train"] > 0 and report.counts["test"] > 0
    assert report.supervised_tokens > 0


def test_inspect_marks_calls_and_answers_not_tool_results(
    trainer_env: TrainerSettings,
    tools_jsonl: Path,
    write_config: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = write_config("inspect-tools", tools_jsonl, max_seq_len=1024, chat_template="chatml-tools")
    capsys.readouterr()
    assert main(["data", "inspect", str(cfg), "--index", "0"]) == 0
    out = capsys.readouterr().out
    assert "tools: get_weather, calculate; 2 call(s) (supervised), 1 tool result(s)" in out
    rendered = out.split("⟧ ---\n", 1)[1].split("--- tokens")[0]
    marked = [part.split("⟧")[0] for part in rendered.split("⟦")[1:]]
    assert len(marked) == 3  # call, worded answer, call
    assert marked[0].startswith("<tool_call>\n{") and marked[2].startswith("<tool_call>\n{")
    assert all(m.endswith("<|im_end|>") for m in marked)
    assert "<tool_response>" in rendered and not any("<tool_response>" in m for m in marked)


def test_the_tool_demo_config_loads_and_its_template_travels_with_the_tokenizer(
    embedded_model: Path, tmp_path: Path
) -> None:
    from importlib.resources import files

    from transformers import AutoTokenizer

    config = load_config(Path(str(files("trainer") / "configs" / "demo-tools.yaml")))
    assert config.chat_template == "chatml-tools"
    tok = apply_choice(AutoTokenizer.from_pretrained(embedded_model), config.chat_template)
    tok.save_pretrained(tmp_path / "adapter")  # what publishing does: the adapter carries it
    again = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    assert again.chat_template == template_text("chatml-tools") and supports_tools(again)
    with pytest.raises(NotFound, match="neither a shipped template nor a file"):
        apply_choice(again, "chatml-nope")


def test_the_adapter_records_the_template_and_the_tool_parser_serving_needs(
    embedded_model: Path,
) -> None:
    """publishing.publish_adapter puts this record in the adapter manifest's
    metadata.chat_format; the inference service sets vLLM's flags from it."""
    import hashlib

    text = template_text("chatml-tools")
    record = chat_format_record(text, "chatml-tools", "chat_template.jinja", True)
    assert record == {
        "template": "chatml-tools",
        "template_file": "chat_template.jinja",
        "template_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tools": True,
        "tool_call_parser": "hermes",  # <tool_call> JSON blocks: what vLLM's hermes parser reads
    }
    plain = chat_format_record(text, "chatml-tools", "chat_template.jinja", False)
    assert plain["tool_call_parser"] is None  # no tool chats trained: no parser asked for
    smollm2 = (embedded_model / "chat_template.jinja").read_text()
    own = chat_format_record(smollm2, None, "chat_template.jinja", True)
    assert own["template"] == "" and own["tool_call_parser"] is None  # no Hermes calls in it
