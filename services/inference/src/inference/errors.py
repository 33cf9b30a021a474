"""Errors of the inference service and the one place they become HTTP statuses.

LorastackError (lorastack.errors)
├── ConfigError / InvalidName    400
│   └── InvalidInput             400  a malformed body (not JSON, too deep, wrong fields)
│       ├── BodyTooLarge         413
│       └── NotJson              415
├── NotFound                     404
├── Conflict                     409
├── IntegrityError               502 (the store gave bytes that do not verify)
├── StoreUnavailable             503
├── Refused                      409
└── EngineFailed                 503  vLLM would not start, exited, or refused a call

Every error answer has the OpenAI shape the gateway uses too, plus the hint:
`{"error": {"message", "type", "param", "code", "hint"}}` (`error_body`).
"""

from __future__ import annotations

from typing import Any

from lorastack.errors import (
    ConfigError,
    Conflict,
    IntegrityError,
    LorastackError,
    NotFound,
    Refused,
    StoreUnavailable,
)
from lorastack.untrusted_json import BodyTooLarge, NotJson


class EngineFailed(LorastackError):
    """vLLM did not start, exited, or answered an admin call with an error."""

    def __init__(self, message: str, hint: str = "", status: int = 503) -> None:
        super().__init__(message, hint)
        self.status = status  # HTTP status the supervisor answers with


class AdminDenied(LorastackError):
    """/admin/* without the admin key (401), or with no key set on a public bind (403)."""

    def __init__(self, message: str, hint: str = "", status: int = 401) -> None:
        super().__init__(message, hint)
        self.status = status


def http_status(error: LorastackError) -> int:
    """The HTTP status for an expected error (the only mapping in this service)."""
    if isinstance(error, EngineFailed | AdminDenied):
        return error.status
    for cls, status in (
        (BodyTooLarge, 413),
        (NotJson, 415),
        (ConfigError, 400),
        (NotFound, 404),
        (Conflict, 409),
        (Refused, 409),
        (IntegrityError, 502),
        (StoreUnavailable, 503),
    ):
        if isinstance(error, cls):
            return status
    return 500


def error_body(error: LorastackError, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer."""
    return {
        "error": {
            "message": error.message,
            "type": type(error).__name__,
            "param": param,
            "code": http_status(error),
            "hint": error.hint,
        }
    }
