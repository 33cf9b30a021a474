"""JSON from outside (request bodies, dataset lines), parsed with limits.

Owns the checks the standard decoder does not make, each raising `InvalidInput` with a
message that says what to change:

- the text is UTF-8 and holds no lone UTF-16 surrogate, escaped (`"\\ud800"`) or raw:
  such a string cannot be encoded again (tokenizers, logs and responses fail on it);
- containers nest at most `MAX_DEPTH` deep (the decoder itself recurses and would raise
  RecursionError near 1,000 levels);
- numbers are finite and integers fit in 64 bits (no NaN, Infinity, 1e999 or a
  4,000-digit integer);
- the top level is an object.

The common request costs two `bytes.count` calls and a regex search over the text on top
of `json.loads`; the walks over the parsed value run only when those say they must.
`read_object` adds what an HTTP body needs on top: a JSON content type (`NotJson`, 415)
and a size limit checked while the body arrives (`BodyTooLarge`, 413). A body declared as
another type is refused even when it parses as JSON (what `curl -d` without a `-H` sends is
`application/x-www-form-urlencoded`), as vLLM's OpenAI server (`validate_json_request`)
and OpenAI's API refuse it: a client that works here works against them. A body with no
content type is read as JSON.
Does not own: what the object must contain (each caller's schema does that), HTTP
statuses (each service maps these errors in its one place).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterable
from typing import Any

from pydantic import ValidationError

from lorastack.errors import InvalidInput, field_errors

MAX_DEPTH = 64  # nested arrays/objects; an OpenAI request needs fewer than 10
INT_LIMIT = 2**63  # integers must lie in [-2**63, 2**63)
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
}
FORM = "application/x-www-form-urlencoded"  # what `curl -d` declares without a -H
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
# text decoded from UTF-8 holds no raw surrogate (the strict codec refuses them), so only
# escaped ones are looked for: a search with a literal prefix, ~30x faster over megabytes
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
# characters: a longer text is parsed with a Python call per JSON object, where a thread
# parsing it lets others have the GIL (the C scanner alone holds it ~40 ms for 4 MiB)
YIELDING_CHARS = 1 << 16


class BodyTooLarge(InvalidInput):
    """The body is over the size limit (HTTP 413)."""


class NotJson(InvalidInput):
    """The body is declared as something other than JSON (HTTP 415)."""


def _reject_constant(name: str) -> Any:
    raise InvalidInput(
        f"{name} is not a JSON number", "send a finite number (JSON has no NaN or Infinity)"
    )


def _parse_int(text: str) -> int:
    if len(text) > 20:  # 2**63 has 19 digits; beyond 20 characters it cannot fit
        raise InvalidInput(
            f"the integer {text[:12]}... has {len(text)} digits; integers must fit in 64 bits",
            "send a smaller number",
        )
    value = int(text)
    if not -INT_LIMIT <= value < INT_LIMIT:
        raise InvalidInput(f"the integer {text} does not fit in 64 bits", "send a smaller number")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInput(
            f"the number {text[:24]} is out of range (a 64-bit float is at most ~1.8e308)",
            "send a smaller number",
        )
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)  # as the scanner builds it: the last of a repeated key wins


# one decoder for every call: json.loads with hooks builds a decoder and its scanner each time
_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_int=_parse_int, parse_float=_parse_float
)
_YIELDING_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant,
    parse_int=_parse_int,
    parse_float=_parse_float,
    object_pairs_hook=_object,
)


def _path(parts: list[str | int]) -> str:
    text = ".".join(str(p) for p in parts) or "(top level)"
    return text if len(text) <= 60 else text[:57] + "..."


def _depth_exceeded(value: Any, max_depth: int) -> list[str | int] | None:
    """The path of the first container nested deeper than `max_depth`, iteratively."""
    stack: list[tuple[Any, int, list[str | int]]] = [(value, 1, [])]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            return where
        if isinstance(node, dict):
            stack.extend(
                (v, depth + 1, [*where, k]) for k, v in node.items() if isinstance(v, dict | list)
            )
        elif isinstance(node, list):
            stack.extend(
                (v, depth + 1, [*where, i])
                for i, v in enumerate(node)
                if isinstance(v, dict | list)
            )
    return None


def _lone_surrogate(value: Any) -> tuple[list[str | int], str] | None:
    """The path and text of the first string (key or value) holding a lone surrogate."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                return where, node[e.start : e.start + 1]
        elif isinstance(node, dict):
            for k, v in node.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError as e:
                    return [*where, k.encode("utf-8", "replace").decode()], k[e.start : e.start + 1]
                stack.append((v, [*where, k]))
        elif isinstance(node, list):
            stack.extend((v, [*where, i]) for i, v in enumerate(node))
    return None


def _text_of(data: bytes | str, what: str) -> tuple[str, re.Pattern[str]]:
    """`data` as text (InvalidInput where bytes are not UTF-8), and the pattern that finds
    a lone surrogate in it (escaped only, in decoded bytes)."""
    if isinstance(data, str):
        return data, _SURROGATE
    try:
        return data.decode("utf-8"), _ESCAPED_SURROGATE
    except UnicodeDecodeError as e:
        raise InvalidInput(
            f"{what} is not valid UTF-8: byte {e.start} ({data[e.start : e.start + 1]!r})"
            f" {e.reason}",
            "encode the text as UTF-8",
        ) from None


def loads_object(
    data: bytes | str, *, what: str = "the body", max_depth: int = MAX_DEPTH
) -> dict[str, Any]:
    """Parse `data` as one JSON object within the limits above; `what` names it in errors."""
    text, surrogate = _text_of(data, what)
    where: list[str | int] | None
    try:
        if text.startswith("\ufeff"):  # as json.loads says it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        value = (_YIELDING_DECODER if len(text) > YIELDING_CHARS else _DECODER).decode(text)
    except RecursionError:  # deeper than the decoder's own recursion limit (~1,000)
        value, where = None, []
    except json.JSONDecodeError as e:
        raise InvalidInput(
            f"{what} is not valid JSON: {e.msg} at "
            + (f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno} column {e.colno}"),
            "send one JSON object",
        ) from None
    else:
        opened = text.count("[") + text.count("{")  # an upper bound of the depth
        where = _depth_exceeded(value, max_depth) if opened > max_depth else None
    if where is not None:
        at = f" (at {_path(where)})" if where else ""
        raise InvalidInput(
            f"{what} nests arrays/objects more than {max_depth} deep{at}",
            f"flatten it to at most {max_depth} levels",
        )
    if surrogate.search(text):  # rare: escaped non-BMP text, or a broken string
        found = _lone_surrogate(value)
        if found is not None:
            where, char = found
            raise InvalidInput(
                f"{what} holds a lone UTF-16 surrogate {char.encode('unicode_escape').decode()!r}"
                f" at {_path(where)}, which is not valid Unicode text",
                "send each character outside the BMP as a surrogate pair or as UTF-8",
            )
    if not isinstance(value, dict):
        raise InvalidInput(
            f"{what} must be a JSON object, not {_JSON_TYPES.get(type(value), 'null')}",
            "send a JSON object",
        )
    return value


def is_json_type(content_type: str) -> bool:
    """application/json or any application/*+json, parameters (charset) aside."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def read_object(
    chunks: AsyncIterable[bytes],
    *,
    content_type: str | None,
    content_length: str | None,
    limit: int,
    max_depth: int = MAX_DEPTH,
) -> tuple[dict[str, Any], bytes]:
    """An HTTP request body: (the object, its raw bytes). A missing content type is taken
    as JSON; a declared other one is refused (the module docstring says why)."""
    check_body_head(content_type, content_length, limit)
    raw = b""
    async for chunk in chunks:
        raw += chunk
        if len(raw) > limit:
            raise body_over(limit)
    return loads_object(raw, max_depth=max_depth), raw


def check_body_head(content_type: str | None, content_length: str | None, limit: int) -> None:
    """What `read_object` checks before reading a body: a JSON content type (a missing one
    is taken as JSON) and a declared length within `limit`."""
    if content_type is not None and not is_json_type(content_type):
        form = content_type.split(";", 1)[0].strip().lower() == FORM
        raise NotJson(
            f"the body is sent as {content_type[:100]!r}; this route takes JSON",
            "send the header 'Content-Type: application/json' with a JSON object"
            + (" (curl -d sends this form type unless -H names another)" if form else ""),
        )
    if content_length and content_length.isdigit() and int(content_length) > limit:
        raise BodyTooLarge(
            f"the request body has {content_length} bytes; the limit is {limit}",
            "send a shorter body (a shorter prompt, fewer messages)",
        )


def body_over(limit: int) -> BodyTooLarge:
    """The error for a body that grew past `limit` bytes while it was read."""
    return BodyTooLarge(
        f"the request body is over {limit} bytes",
        "send a shorter body (a shorter prompt, fewer messages)",
    )


def schema_error(e: ValidationError) -> tuple[str, str]:
    """(where, what) of a pydantic error's first entry, for a message: ("messages.0.role",
    "Input should be 'system', 'user' or 'assistant'")."""
    return field_errors(e)[0]
