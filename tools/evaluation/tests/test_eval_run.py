"""`run_eval` end to end against the fake OpenAI server on loopback: prompts, scores,
verdicts, the three files, provenance and publishing to a store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from evaluation import EvalConfig, run_eval
from evaluation.eval_config import load_eval_config
from evaluation.eval_run import baseline_prompt, default_report_name
from lorastack.chat_data import Conversation, write_jsonl
from lorastack.cli import main as cli_main
from lorastack.errors import ConfigError
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack_testing.fake_vllm import FakeServer


def _answer(model: str, prompt: str) -> str:
    # the "LoRA" learnt the task (upper-case the word); the base model echoes it
    return prompt.upper() if model == "fake-lora" else prompt


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    models = [{"id": "fake-base"}, {"id": "fake-lora"}]
    with FakeServer(models=models, answer=_answer, prompt_tokens=None) as f:
        yield f


def _test_file(tmp_path: Path, n: int = 40) -> Path:
    convs = [
        Conversation.model_validate(
            {"messages": [{"role": "system", "content": "Upper-case the word."},
                          {"role": "user", "content": f"word{i}"},
                          {"role": "assistant", "content": f"WORD{i}"}]}
        )
        for i in range(n)
    ]  # fmt: skip
    path = tmp_path / "test.jsonl"
    write_jsonl(path, convs)
    return path


def test_lora_better_than_baseline(fake: FakeServer, tmp_path: Path) -> None:
    cfg = EvalConfig(
        base_url=fake.base_url,
        test=str(_test_file(tmp_path)),
        base_model="fake-base",
        lora_model="fake-lora",
        system_prompt="Answer in capitals.",
        few_shot=[{"user": "cat", "assistant": "CAT"}],  # type: ignore[list-item]
        scorers=["exact", "normalised", "contains", "regex:^[A-Z0-9]+$", "json_valid"],
        max_tokens=8,
        concurrency=4,
    )
    out = tmp_path / "eval"
    report = run_eval(cfg, out_dir=out)
    assert report.n == 40
    assert report.verdicts == {
        "exact": "improvement",
        "normalised": "uncertain",  # case folding makes both right
        "contains": "uncertain",
        "regex": "improvement",
        "json_valid": "uncertain",  # neither is JSON
    }
    assert report.metrics["exact"].baseline_mean == 0.0
    assert report.metrics["exact"].candidate_mean == 1.0
    # every request was greedy with bounded length, and the baseline got its prompt
    bodies = [b for b in fake.requests if b.get("model") == "fake-base"][-40:]
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 8 for b in bodies)
    msgs = bodies[0]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == "Answer in capitals."
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 40
    s = samples[0]
    assert s["lora_prompt"][0]["content"] == "Upper-case the word."  # the item's own prompt
    assert s["lora"]["scores"]["exact"] == 1.0 and s["baseline"]["scores"]["exact"] == 0.0
    assert s["reference"] == "WORD0"
    data = json.loads((out / "report.json").read_text())
    assert data["n"] == 40 and data["test"]["digest"].startswith("sha256:")
    assert "api_key" not in data["config"]
    md = (out / "report.md").read_text()
    for needle in (
        "## Frozen test split",
        "n = 40",
        "**improvement**",
        "What this evidence cannot show",
        "Greedy decoding",
    ):
        assert needle in md


def test_baseline_prompt_replaces_system_and_adds_shots() -> None:
    cfg = EvalConfig(base_url="http://x", test="t.jsonl", base_model="b", lora_model="l",
                     few_shot=[{"user": "u1", "assistant": "a1"}])  # type: ignore[list-item]  # fmt: skip
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert baseline_prompt(prompt, cfg) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q"},
    ]
    cfg2 = cfg.model_copy(update={"system_prompt": "T", "few_shot": []})
    assert baseline_prompt(prompt, cfg2)[0] == {"role": "system", "content": "T"}
    assert baseline_prompt(prompt[1:], cfg2)[0] == {"role": "system", "content": "T"}


def test_store_refs_provenance_and_publish(fake: FakeServer, tmp_path: Path, home: Path) -> None:
    store = open_store(CommonSettings())
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("{}\n")
    data = store.publish(data_dir, kind="dataset", name="demo/data", service="trainer")
    test_dir = tmp_path / "testsplit"
    test_dir.mkdir()
    _test_file(test_dir, n=12)
    test = store.publish(test_dir, kind="dataset", name="demo/test", service="trainer")
    adapter_dir = tmp_path / "adapter"
    (adapter_dir / "metrics").mkdir(parents=True)
    (adapter_dir / "training-complete.json").write_text(
        json.dumps({"steps": 75, "train_loss": 0.21, "val_loss": 0.35, "wall_time_s": 480.0})
    )
    (adapter_dir / "metrics" / "eval-step-70.json").write_text(
        json.dumps({"step": 70, "val_loss": 0.36})
    )
    (adapter_dir / "metrics" / "metrics-step-75.json").write_text(
        json.dumps({"step": 75, "loss": 0.2})
    )
    adapter = store.publish(adapter_dir, kind="adapter", name="demo/adapter", service="trainer",
                            parents=[data.as_parent("dataset")])  # fmt: skip

    cfg = EvalConfig(base_url=fake.base_url + "/v1", test="demo/test", base_model="fake-base",
                     lora_model="fake-lora", adapter="demo/adapter", max_tokens=4)  # fmt: skip
    assert default_report_name(cfg.test) == "demo/eval"
    report = run_eval(cfg, out_dir=tmp_path / "out", store=store, publish_as="demo/eval")
    assert report.test.ref == test.ref and report.test.digest == test.digest
    assert report.adapter is not None
    assert report.adapter.training["train_loss"] == 0.21
    assert report.adapter.training["last_step.loss"] == 0.2
    assert report.adapter.validation["val_loss"] == 0.35
    assert report.adapter.validation["eval-step-70.val_loss"] == 0.36
    assert "val_loss" not in report.adapter.training
    assert report.adapter.train_data is not None and report.adapter.train_data.digest == data.digest
    published = store.resolve("demo/eval")
    assert published.kind == "report" and report.published == published.ref
    assert {p.role for p in published.parents} == {"test", "adapter"}
    assert {f.path for f in published.files} == {"report.md", "report.json", "samples.jsonl"}
    assert adapter.digest in (tmp_path / "out" / "report.md").read_text()
    md = (tmp_path / "out" / "report.md").read_text()
    assert (
        md.index("Seen during training")
        < md.index("## Validation")
        < md.index("What this evidence")
    )
    assert "n < 30" in md


def test_unknown_model_is_a_clear_error(fake: FakeServer, tmp_path: Path) -> None:
    cfg = EvalConfig(base_url=fake.base_url, test=str(_test_file(tmp_path, 2)),
                     base_model="fake-base", lora_model="gpt-4")  # fmt: skip
    with pytest.raises(ConfigError, match="'gpt-4' is not served"):
        run_eval(cfg, out_dir=tmp_path / "o")


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    p = tmp_path / "eval.yaml"
    p.write_text(
        "base_url: http://x\ntest: t.jsonl\nbase_model: b\nlora_model: l\nmax_tokens: 0\ncolour: red\n"
    )
    with pytest.raises(ConfigError) as e:
        load_eval_config(p, {})
    assert "max_tokens" in e.value.message and "colour" in e.value.message


def test_cli_eval(
    fake: FakeServer, tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(
        "system_prompt: Answer in capitals.\n"
        "scorers: [exact, {name: regex, pattern: '^[A-Z0-9]+$', label: caps}]\n"
    )
    out = tmp_path / "cli-out"
    code = cli_main([
        "eval", "--config", str(cfg), "--base-url", fake.base_url, "--test", str(_test_file(tmp_path, 30)),
        "--base-model", "fake-base", "--lora-model", "fake-lora", "--max-tokens", "4", "--out", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "exact" in printed and "improvement" in printed and "caps" in printed
    assert (out / "report.md").is_file()
    # --limit under the exact test's minimum: it runs, says so first, and cannot improve
    code = cli_main([
        "eval", "--config", str(cfg), "--base-url", fake.base_url, "--test", str(_test_file(tmp_path, 30)),
        "--base-model", "fake-base", "--lora-model", "fake-lora", "--max-tokens", "4",
        "--out", str(tmp_path / "limited"), "--limit", "1", "--no-publish",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and "--limit 1 is under the 6 paired items" in captured.err
    assert "improvement" not in captured.out and "too few items (n = 1 < 6)" in captured.out
    code = cli_main(["eval", "--base-url", fake.base_url, "--test", str(tmp_path / "missing.jsonl"),
                     "--base-model", "a", "--lora-model", "b", "--out", str(out)])  # fmt: skip
    assert code == 2


def _tool_answer(model: str, prompt: str) -> str:
    # the "LoRA" calls the function with the city of the question; the base model talks
    if model != "fake-lora":
        return "I cannot look up the weather."
    city = prompt.split()[-1].rstrip("?")
    return f'<tool_call> {{"name": "get_weather", "arguments": {{"city": "{city}"}}}} </tool_call>'


def test_tool_calls_are_sent_read_and_scored(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    convs = [
        Conversation.model_validate(
            {"tools": tools, "messages": [
                {"role": "user", "content": f"Weather in City{i}?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"c{i}", "type": "function",
                    "function": {"name": "get_weather", "arguments": f'{{"city": "City{i}"}}'}}]},
            ]}
        )
        for i in range(20)
    ]  # fmt: skip
    path = tmp_path / "tools.jsonl"
    write_jsonl(path, convs)
    models = [{"id": "fake-base"}, {"id": "fake-lora"}]
    with FakeServer(models=models, answer=_tool_answer, prompt_tokens=None) as fake:
        cfg = EvalConfig(base_url=fake.base_url, test=str(path), base_model="fake-base",
                         lora_model="fake-lora", scorers=["tool_call", {"name": "tool_call", "arguments": "equal", "label": "args_equal"}],
                         max_tokens=32)  # fmt: skip
        report = run_eval(cfg, out_dir=tmp_path / "eval")
        bodies = fake.requests
    assert all(b["tools"] == tools for b in bodies if "messages" in b)
    assert report.metrics["tool_call"].candidate_mean == 1.0
    assert report.metrics["tool_call"].baseline_mean == 0.0
    assert report.verdicts == {"tool_call": "improvement", "args_equal": "improvement"}
    sample = json.loads((tmp_path / "eval" / "samples.jsonl").read_text().splitlines()[0])
    assert json.loads(sample["reference"])["tool_calls"][0]["name"] == "get_weather"
    assert json.loads(sample["lora"]["output"]) == json.loads(sample["reference"])
