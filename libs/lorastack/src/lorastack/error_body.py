"""The message of an error answer from an OpenAI-compatible server, for our own messages.

vLLM, the gateway and OpenAI answer `{"error": {"message": ...}}`; FastAPI's own errors
`{"detail": "..."}`; a proxy in between may answer plain text. Pure (text in, text out):
the caller does the HTTP.
"""

from __future__ import annotations

import json

LIMIT = 500  # characters: enough for any server's message, short enough for one line


def error_message(text: str, limit: int = LIMIT) -> str:
    """The server's own message in an error body `text`, else the text itself (cut)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:limit]
    if isinstance(body, dict):
        err = body.get("error", body)  # some servers answer the error object alone
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:limit]
        if isinstance(err, str):
            return err[:limit]
        if isinstance(body.get("detail"), str):
            return str(body["detail"])[:limit]
    return text[:limit]
