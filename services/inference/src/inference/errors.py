"""Errors of the inference service and the one place they become HTTP statuses.

LorastackError (lorastack.errors)
├── ConfigError / InvalidName    400
├── NotFound                     404
├── Conflict                     409
├── IntegrityError               502 (the store gave bytes that do not verify)
├── StoreUnavailable             503
├── Refused                      409
└── EngineFailed                 503  vLLM would not start, exited, or refused a call
"""

from __future__ import annotations

from lorastack.errors import (
    ConfigError,
    Conflict,
    IntegrityError,
    LorastackError,
    NotFound,
    Refused,
    StoreUnavailable,
)


class EngineFailed(LorastackError):
    """vLLM did not start, exited, or answered an admin call with an error."""

    def __init__(self, message: str, hint: str = "", status: int = 503) -> None:
        super().__init__(message, hint)
        self.status = status  # HTTP status the supervisor answers with


def http_status(error: LorastackError) -> int:
    """The HTTP status for an expected error (the only mapping in this service)."""
    if isinstance(error, EngineFailed):
        return error.status
    for cls, status in (
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
