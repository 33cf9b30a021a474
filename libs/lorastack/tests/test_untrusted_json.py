"""untrusted_json.loads_object with its one shared decoder: the same errors as
json.loads with the hooks (a BOM, bad numbers, broken JSON), and a decoder that keeps
no state between bodies."""

from __future__ import annotations

import pytest

from lorastack.errors import InvalidInput
from lorastack.untrusted_json import loads_object


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
