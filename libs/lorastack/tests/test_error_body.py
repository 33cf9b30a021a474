"""`error_message`: the server's own words from an error answer, whatever shape it has."""

from __future__ import annotations

import json

import pytest

from lorastack.error_body import error_message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"error": {"message": "The model `x` does not exist.", "code": 404}}, "The model `x`"),
        ({"message": "max_tokens too large", "type": "BadRequestError"}, "max_tokens too large"),
        ({"error": "adapter busy"}, "adapter busy"),
        ({"detail": "Not Found"}, "Not Found"),
    ],
)
def test_the_server_s_message_from_each_shape(body: object, message: str) -> None:
    assert error_message(json.dumps(body)).startswith(message)


def test_anything_else_is_the_text_itself_cut() -> None:
    assert error_message("<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"
    assert error_message('["a list"]') == '["a list"]'
    assert error_message("x" * 2000) == "x" * 500
    assert error_message(json.dumps({"error": {"message": "y" * 900}}), limit=10) == "y" * 10
