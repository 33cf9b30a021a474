"""Scorers: how one model output is compared with the reference answer.

A scorer is any callable `(output, reference) -> float` in [0, 1]. The built-in ones
are registered by name in `SCORERS`; `register_scorer` adds more (a plugin calls it at
import). `build_scorer(spec)` turns a config entry (`exact`, `regex:^\\d+$`, or
`{"name": "regex", "pattern": ...}`) into a `NamedScorer`. No I/O here.

    exact       output.strip() == reference.strip()
    normalised  equal after NFKC, lower case, collapsed white space, trimmed quotes/punctuation
    contains    the normalised reference occurs inside the normalised output
    regex       the pattern (re.search) matches the output; the pattern comes from the config
    json_valid  the whole output (trimmed; one ```json fence allowed) parses as JSON
    tool_call   right function(s), valid arguments: the answer calls the reference's
                functions in order, each with arguments that are a JSON object
                (`arguments: keys` also wants the reference's argument names, `equal` its
                values); a reference without calls wants an answer without calls.
                Both sides in `evaluation.tool_calls`' text form.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from evaluation.tool_calls import read_calls
from lorastack.errors import ConfigError


class Scorer(Protocol):
    """A scorer: (output, reference) -> a score in [0, 1]."""

    def __call__(self, output: str, reference: str) -> float: ...


ScorerFactory = Callable[..., Scorer]  # keyword options from the config -> scorer

SCORERS: dict[str, ScorerFactory] = {}


def register_scorer(name: str) -> Callable[[ScorerFactory], ScorerFactory]:
    """Decorator: make a scorer factory available under `name` in configs and flags."""

    def add(factory: ScorerFactory) -> ScorerFactory:
        SCORERS[name] = factory
        return factory

    return add


_EDGE = " \t\r\n\"'`.,;:!?()[]{}"


def normalise(text: str) -> str:
    """NFKC, lower case, runs of white space to one space, quotes/punctuation trimmed."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(text.split()).strip(_EDGE)


@register_scorer("exact")
def exact() -> Scorer:
    """A scorer: 1 when the output equals the reference, white space at the ends aside."""
    return lambda output, reference: float(output.strip() == reference.strip())


@register_scorer("normalised")
def normalised() -> Scorer:
    """A scorer: 1 when the output equals the reference after `normalise`."""
    return lambda output, reference: float(normalise(output) == normalise(reference))


@register_scorer("contains")
def contains() -> Scorer:
    """A scorer: 1 when the normalised output contains the normalised (non-empty) reference."""

    def score(output: str, reference: str) -> float:
        ref = normalise(reference)
        return float(bool(ref) and ref in normalise(output))

    return score


@register_scorer("regex")
def regex(pattern: str | None = None) -> Scorer:
    """A scorer: 1 when `pattern` matches somewhere in the output.

    Raises ConfigError without a pattern or for an invalid one."""
    if not pattern:
        raise ConfigError(
            "the regex scorer needs a pattern",
            "write it as regex:PATTERN on the command line or {name: regex, pattern: ...} in YAML",
        )
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"invalid regex {pattern!r}: {e}", "fix the pattern (Python re syntax)"
        ) from e
    return lambda output, reference: float(compiled.search(output) is not None)


_FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.DOTALL)


@register_scorer("json_valid")
def json_valid() -> Scorer:
    """A scorer: 1 when the output (or the JSON in its code fence) parses as JSON."""

    def score(output: str, reference: str) -> float:
        text = output.strip()
        if m := _FENCE.match(text):
            text = m.group(1)
        try:
            json.loads(text)
        except ValueError:
            return 0.0
        return 1.0

    return score


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@register_scorer("tool_call")
def tool_call(arguments: str = "valid", pattern: str | None = None) -> Scorer:
    """A scorer: 1 when the output makes the reference's tool calls: same names, and arguments
    that are a JSON object (`valid`), with its keys (`keys`) or its values (`equal`); 1 for no
    call when the reference has none.

    Raises ConfigError for another level."""
    arguments = pattern or arguments  # the flag form: tool_call:equal
    if arguments not in ("valid", "keys", "equal"):
        raise ConfigError(
            f"tool_call arguments={arguments!r} is not a level",
            "use valid (a JSON object), keys (the reference's names) or equal (its values)",
        )

    def score(output: str, reference: str) -> float:
        want, got = read_calls(reference), read_calls(output)
        if want is None:  # the item expects a plain answer
            return float(not got)
        if not got or len(got) != len(want):
            return 0.0
        for (name, args), (want_name, want_args) in zip(got, want, strict=True):
            parsed, expected = _object(args), _object(want_args) or {}
            if name != want_name or parsed is None:
                return 0.0
            if arguments == "keys" and set(parsed) != set(expected):
                return 0.0
            if arguments == "equal" and parsed != expected:
                return 0.0
        return 1.0

    return score


@dataclass(frozen=True)
class NamedScorer:
    """A scorer with its metric name and options; raises ConfigError for a score outside [0, 1]."""

    name: str  # the metric's name in reports, e.g. "exact" or "regex"
    score: Scorer
    options: dict[str, Any]

    def __call__(self, output: str, reference: str) -> float:
        value = float(self.score(output, reference))
        if not 0.0 <= value <= 1.0:
            raise ConfigError(
                f"scorer {self.name} returned {value}", "a scorer returns a number in [0, 1]"
            )
        return value


def parse_scorer_flag(flag: str) -> dict[str, Any]:
    """`regex:^\\d+$` -> {"name": "regex", "pattern": "^\\d+$"}; `exact` -> {"name": "exact"}."""
    name, sep, pattern = flag.partition(":")
    return {"name": name, "pattern": pattern} if sep else {"name": name}


def build_scorer(spec: str | dict[str, Any]) -> NamedScorer:
    """The scorer `spec` names (`name[:PATTERN]` or a mapping with its options).

    Raises ConfigError for an unknown scorer or options it does not take."""
    spec = parse_scorer_flag(spec) if isinstance(spec, str) else dict(spec)
    name = str(spec.pop("name", ""))
    label = str(spec.pop("label", "") or name)
    if name not in SCORERS:
        raise ConfigError(
            f"unknown scorer {name!r}", f"use one of {', '.join(sorted(SCORERS))} (or register one)"
        )
    options = {k: v for k, v in spec.items() if v is not None}
    try:
        fn = SCORERS[name](**options)
    except TypeError as e:
        raise ConfigError(
            f"scorer {name!r} got options it does not take: {sorted(options)}",
            "check the scorer's options (regex takes 'pattern', tool_call 'arguments'; the "
            "others take none)",
        ) from e
    return NamedScorer(name=label, score=fn, options=options)
