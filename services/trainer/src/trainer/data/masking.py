"""Which tokens are supervised: pure functions over rendered text, char offsets and ids.

Masking is by position, never by token id: in SmolLM2 the pad token and the
end-of-turn token are the same id (2), so masking "every pad" would also mask the
end-of-turn and the model would never learn to stop.

A target is the content of an assistant message plus the end-of-turn token that the
chat template puts right after it; for an assistant turn that calls tools, everything
the template writes between the turn's header and its end-of-turn (the calls, and any
content before them). Everything else (system prompt, user turns, tool results, role
headers, the newline after the end-of-turn, padding) gets the label IGNORE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

IGNORE = -100  # label value cross-entropy skips


class MaskingError(ValueError):
    """The template does not render a target where the masking expects it."""


@dataclass(frozen=True)
class Span:
    """A half-open range of characters of the rendered text."""

    start: int  # char offset, inclusive
    end: int  # char offset, exclusive


def locate_target(rendered: str, prompt_end: int, content: str) -> Span:
    """The span of `content` in `rendered`, which must start at `prompt_end` (the length
    of the text rendered up to and including the assistant header)."""
    if rendered[prompt_end : prompt_end + len(content)] == content:
        return Span(prompt_end, prompt_end + len(content))
    raise MaskingError(
        f"the chat template does not render the assistant content verbatim after its header "
        f"(expected {content[:40]!r} at char {prompt_end})"
    )


def locate_calls(
    rendered: str, prompt_end: int, end_of_turn: str, calls: Sequence[tuple[str, Sequence[str]]]
) -> Span:
    """The span of an assistant turn that calls tools: from `prompt_end` (after its
    header) to its end-of-turn text. `calls` are (function name, argument names): each
    must be written inside the span, or the template dropped the call."""
    end = rendered.find(end_of_turn, prompt_end) if end_of_turn else -1
    if end < 0:
        raise MaskingError(
            f"no end-of-turn {end_of_turn!r} after the tool call at char {prompt_end}"
        )
    text = rendered[prompt_end:end]
    for name, arguments in calls:
        missing = [repr(a) for a in (name, *arguments) if a not in text]
        if missing:
            raise MaskingError(
                f"the chat template drops the tool call {name}: {', '.join(missing)} not in the "
                f"rendered assistant turn {text[:80]!r}; the template has no tool support"
            )
    return Span(prompt_end, end)


def check_tools_rendered(rendered: str, functions: Sequence[str], results: Sequence[str]) -> None:
    """Every function of `tools` and every tool result is in the text the model sees."""
    for name in functions:
        if name not in rendered:
            raise MaskingError(
                f"the chat template drops the tools list (function {name!r} is not rendered): "
                "the model would be trained to call functions it is never shown"
            )
    for result in results:
        if result not in rendered:
            raise MaskingError(
                f"the chat template drops a tool result ({result[:40]!r} is not rendered)"
            )


def supervised_mask(
    offsets: Sequence[tuple[int, int]],
    ids: Sequence[int],
    spans: Sequence[Span],
    end_of_turn_id: int,
) -> list[bool]:
    """True for tokens inside a target span, and for the end-of-turn token right after it.

    A token is inside a span when its chars overlap the span. Raises MaskingError when
    the token after a span is not the end-of-turn token (the target would then never
    teach the model to stop).
    """
    mask = [False] * len(ids)
    for span in spans:
        after = None
        for i, (s, e) in enumerate(offsets):
            if e > span.start and s < span.end and e > s:
                mask[i] = True
            elif s >= span.end and e > s:
                after = i
                break
        if after is None or ids[after] != end_of_turn_id or offsets[after][0] != span.end:
            raise MaskingError(
                f"no end-of-turn token (id {end_of_turn_id}) right after the target ending at "
                f"char {span.end}"
            )
        mask[after] = True
    return mask


def labels_from_mask(ids: Sequence[int], mask: Sequence[bool]) -> list[int]:
    """The labels of `ids`: the token where `mask` is true, IGNORE elsewhere."""
    return [t if m else IGNORE for t, m in zip(ids, mask, strict=True)]


def targets_end_with(labels: Sequence[int], end_of_turn_id: int) -> bool:
    """Every run of supervised labels ends with the end-of-turn id (and there is one)."""
    runs_ok = True
    prev = IGNORE
    for lab in [*labels, IGNORE]:
        if lab == IGNORE and prev != IGNORE and prev != end_of_turn_id:
            runs_ok = False
        prev = lab
    return runs_ok and any(lab != IGNORE for lab in labels)


def part_lengths(
    offsets: Sequence[tuple[int, int]], system_end: int, target: Span
) -> dict[str, int]:
    """Token counts per part: system (chars before `system_end`), target (chars inside
    `target`, which includes its end-of-turn token) and history (all the rest: user
    turns, earlier assistant turns, role headers)."""
    counts = {"system": 0, "history": 0, "target": 0}
    for s, e in offsets:
        if s < system_end:
            counts["system"] += 1
        elif s < target.end and e > target.start:
            counts["target"] += 1
        else:
            counts["history"] += 1
    return counts
