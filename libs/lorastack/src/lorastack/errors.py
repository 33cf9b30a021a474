"""The error tree shared by every service.

Every error a user can cause carries a message that says what went wrong and a hint
that says what to change. Services map these to exit codes (CLI) or HTTP statuses
(gateway, inference) in one place each.

    LorastackError
    ├── ConfigError        a setting, config field or argument is invalid
    │   ├── InvalidName    an artifact name or version breaks the naming rules
    │   └── InvalidInput   a request body or data line is malformed (untrusted_json)
    ├── NotFound           an artifact, version or file does not exist
    ├── Conflict           the artifact version was already published by someone else
    ├── IntegrityError     a downloaded file does not match its recorded sha256
    │   └── InvalidManifest  a manifest or store record read back breaks the rules (names the field)
    ├── StoreUnavailable   the store could not be reached after bounded retries
    └── Refused            a check refused to go on (preflight, resume, merge, ...)

`field_errors` words a pydantic ValidationError as the fields it names, for the message of
one of these errors (a config file, the settings, a request body).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class LorastackError(Exception):
    """Base of all expected errors; `hint` says what the user should change."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(LorastackError):
    """A setting, config field or command-line argument is invalid."""


class InvalidName(ConfigError):
    """An artifact name or version breaks the naming rules."""


class InvalidInput(ConfigError):
    """A request body or a data line is malformed (bad UTF-8, too deep, not an object...)."""


class NotFound(LorastackError):
    """An artifact, version or file does not exist."""


class Conflict(LorastackError):
    """Someone else already published this artifact version."""


class IntegrityError(LorastackError):
    """A file's content does not match the sha256 recorded in its manifest."""


class InvalidManifest(IntegrityError):
    """A manifest (or label, declaration) read from the store breaks the rules: a path that
    leaves the artifact, a malformed sha256, a digest that is not its file list's, a name
    or version other than the key it was read from. The message names the field."""


class StoreUnavailable(LorastackError):
    """The store stayed unreachable after bounded retries."""


class Refused(LorastackError):
    """A check refused to continue; the message lists what failed."""

    exit_code = 3


def field_errors(e: ValidationError, whole: str = "") -> list[tuple[str, str]]:
    """(where, what) of each entry of a pydantic error: ("lora.r", "Input should be greater
    than 0"); `whole` stands for an entry about the whole object (no field). A validator's
    own message loses pydantic's "Value error, " in front of it."""
    return [
        (".".join(str(p) for p in err["loc"]) or whole, err["msg"].removeprefix("Value error, "))
        for err in e.errors()
    ]
