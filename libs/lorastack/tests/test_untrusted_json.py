"""untrusted_json.loads_object with its one shared decoder: the same errors as
json.loads with the hooks (a BOM, bad numbers, broken JSON), and a decoder that keeps
no state between bodies; a text long enough for the decoder that lets other threads run
between objects gets the same value and the same errors as a short one."""

from __future__ import annotations

import pytest

from lorastack.errors import InvalidInput
from lorastack.untrusted_json import YIELDING_CHARS, loads_object


def test_the_shared_decoder_says_what_json_loads_said() -> None:
    with pytest.raises(InvalidInput, match="Unexpected UTF-8 BOM"):
        loads_object('\ufeff{"a": 1}')
    with pytest.raises(InvalidInput, match="Unexpected UTF-8 BOM"):
        loads_object('\ufeff{"a": 1}'.encode())
    with pytest.raises(InvalidInput, match="NaN is not a JSON number"):
        loads_object('{"a": NaN}')
    with pytest.raises(InvalidInput, match="out of range"):
        loads_object('{"a": 1e999}')
    with pytest.raises(InvalidInput, match="does not fit in 64 bits"):
        loads_object('{"a": 9223372036854775808}')
    with pytest.raises(InvalidInput, match="not valid JSON: Expecting value at column 7"):
        loads_object('{"a": }')
    # one body after another through the same decoder: nothing carries over
    assert loads_object(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    assert loads_object('{"b": {"c": null}}') == {"b": {"c": None}}


# (text, the error's message or None): each parsed as it is and with a long member after it
SAME_SHORT_OR_LONG = [
    ('{"a": 1, "b": [true, null, 2.5, "x"], "a": {"c": [[]]}}', None),  # the last "a" wins
    ('{"t": [{"name": "f", "parameters": {"type": "object"}}], "n": -3}', None),
    ('{"s": "caf\\u00e9 \\ud83d\\ude00 東京"}', None),  # an escaped surrogate pair is text
    ('{"a": NaN, ', "NaN is not a JSON number"),
    ('{"a": [1e999], ', "out of range"),
    ('{"a": {"b": 9223372036854775808}, ', "does not fit in 64 bits"),
    ('{"a": [1, 2,, 3], ', "not valid JSON: Expecting value at column 13"),
    ('{"a": "\\udc00", ', "lone UTF-16 surrogate '\\\\udc00' at a"),
    ('{"a": ' + "[" * 70 + "]" * 70 + ", ", "nests arrays/objects more than 64 deep"),
]


@pytest.mark.parametrize(("text", "error"), SAME_SHORT_OR_LONG)
@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_long_text_parses_as_a_short_one(text: str, error: str | None, as_bytes: bool) -> None:
    pad = "p" * (YIELDING_CHARS + 1)
    short = text if error is None else text.rstrip(", ") + "}"
    long = (text[:-1] + ", " if error is None else text) + f'"pad": "{pad}"}}'
    assert len(short) < YIELDING_CHARS < len(long)
    results = []
    for one in (short, long):
        data = one.encode() if as_bytes else one
        try:
            results.append(loads_object(data))
        except InvalidInput as e:
            results.append(e.message)
    if error is None:
        assert results[1] == {**results[0], "pad": pad}
    else:
        assert error in results[0] and results[0] == results[1]
