"""Scorers: table tests of each built-in, the registry and config errors."""

from __future__ import annotations

import pytest

from evaluation.scorers import SCORERS, build_scorer, normalise, register_scorer
from evaluation.tool_calls import calls_text, message_calls
from lorastack.errors import ConfigError

BUILT_IN = frozenset(SCORERS)  # at import, before a test below registers plugins


@pytest.mark.parametrize(
    ("spec", "output", "reference", "expected"),
    [
        ("exact", "2021-03-03", "2021-03-03", 1.0),
        ("exact", " 2021-03-03\n", "2021-03-03", 1.0),
        ("exact", "2021-03-03.", "2021-03-03", 0.0),
        ("exact", "Paris", "paris", 0.0),
        ("normalised", "  PARIS. ", "paris", 1.0),
        ("normalised", "“Paris”", '"paris"', 0.0),  # curly quotes are not trimmed
        ("normalised", "New   York", "new york", 1.0),
        ("normalised", "ﬁne", "fine", 1.0),  # NFKC folds the ligature
        ("normalised", "Paris, France", "paris", 0.0),
        ("contains", "The answer is Paris, France.", "paris", 1.0),
        ("contains", "The answer is Lyon.", "paris", 0.0),
        ("contains", "anything", "  ", 0.0),  # an empty reference never matches
        ("regex:^\\d{4}-\\d{2}-\\d{2}$", "2021-03-03", "", 1.0),
        ("regex:^\\d{4}-\\d{2}-\\d{2}$", "on 2021-03-03", "", 0.0),
        ({"name": "regex", "pattern": "\\d+"}, "abc 12", "", 1.0),
        ("json_valid", '{"a": 1}', "", 1.0),
        ("json_valid", '```json\n{"a": [1, 2]}\n```', "", 1.0),
        ("json_valid", "{'a': 1}", "", 0.0),
        ("json_valid", "", "", 0.0),
    ],
)
def test_builtin_scorers(spec: object, output: str, reference: str, expected: float) -> None:
    scorer = build_scorer(spec)  # type: ignore[arg-type]
    assert scorer(output, reference) == expected


CALL = calls_text([("get_weather", '{"city": "Oslo", "unit": "celsius"}')])


@pytest.mark.parametrize(
    ("spec", "output", "expected"),
    [
        ("tool_call", CALL, 1.0),
        ("tool_call", calls_text([("get_weather", '{"city": "Lima"}')]), 1.0),  # valid is enough
        ("tool_call:keys", calls_text([("get_weather", '{"city": "Lima"}')]), 0.0),
        ("tool_call:keys", calls_text([("get_weather", '{"unit": "x", "city": "y"}')]), 1.0),
        (
            "tool_call:equal",
            calls_text([("get_weather", '{"unit": "celsius", "city": "Oslo"}')]),
            1.0,
        ),
        ("tool_call:equal", calls_text([("get_weather", '{"city": "Oslo"}')]), 0.0),
        ("tool_call", calls_text([("calculate", '{"city": "Oslo", "unit": "celsius"}')]), 0.0),
        ("tool_call", calls_text([("get_weather", '{"city": "Oslo"')]), 0.0),  # not JSON
        ("tool_call", calls_text([("get_weather", '["Oslo"]')]), 0.0),  # not an object
        ("tool_call", calls_text([("get_weather", "{}"), ("get_weather", "{}")]), 0.0),
        ("tool_call", "It is 4 degrees in Oslo.", 0.0),  # answered instead of calling
        ("tool_call", '{"tool_calls": "nope"}', 0.0),
    ],
)
def test_tool_call_scorer(spec: str, output: str, expected: float) -> None:
    assert build_scorer(spec)(output, CALL) == expected


def test_tool_call_scorer_wants_no_call_where_the_reference_has_none() -> None:
    scorer = build_scorer("tool_call")
    assert scorer("It is 4 degrees.", "It is 4 degrees.") == 1.0
    assert scorer(CALL, "It is 4 degrees.") == 0.0
    with pytest.raises(ConfigError, match="not a level"):
        build_scorer("tool_call:exact")


@pytest.mark.parametrize(
    ("message", "calls"),
    [
        (
            {
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "calculate", "arguments": '{"a": 1}'},
                    }
                ],
            },
            [("calculate", '{"a": 1}')],
        ),
        (  # a server without a tool parser leaves the Hermes block in the text
            {"content": '<tool_call>\n{"name": "calculate", "arguments": {"a": 1}}\n</tool_call>'},
            [("calculate", '{"a": 1}')],
        ),
        ({"content": "<tool_call>\nnot json\n</tool_call>"}, [("", "not json")]),
        ({"content": "The answer is 3."}, []),
    ],
)
def test_message_calls_reads_tool_calls_or_hermes_blocks(
    message: dict[str, object], calls: list[tuple[str, str]]
) -> None:
    assert message_calls(message) == calls


def test_normalise() -> None:
    assert normalise("  Hello,\tWORLD!! ") == "hello, world"


def test_registry_takes_plugins() -> None:
    @register_scorer("length_ok")
    def length_ok(max_chars: int = 5):  # type: ignore[no-untyped-def]
        return lambda output, reference: float(len(output) <= max_chars)

    try:
        s = build_scorer({"name": "length_ok", "max_chars": 3, "label": "short"})
        assert s.name == "short"
        assert s("abc", "") == 1.0 and s("abcd", "") == 0.0
    finally:
        SCORERS.pop("length_ok")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown scorer 'nope'"),
        ("regex", "needs a pattern"),
        ("regex:([", "invalid regex"),
        ({"name": "exact", "pattern": "x"}, "options it does not take"),
    ],
)
def test_bad_scorer_specs(spec: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_scorer(spec)  # type: ignore[arg-type]


def test_out_of_range_score_is_refused() -> None:
    register_scorer("bad")(lambda: lambda o, r: 2.0)
    try:
        with pytest.raises(ConfigError, match=r"returned 2\.0"):
            build_scorer("bad")("x", "y")
    finally:
        SCORERS.pop("bad")


def test_the_scorer_flag_help_names_every_built_in_scorer() -> None:
    import argparse
    import re

    from evaluation.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    eval_parser = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["eval"]
    (flag,) = [a for a in eval_parser._actions if "--scorer" in a.option_strings]
    assert flag.help is not None
    named = set(re.findall(r"[a-z_]+", flag.help))
    assert named >= BUILT_IN, sorted(BUILT_IN - named)
