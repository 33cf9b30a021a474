"""What a usable secret is: the one rule every service applies to the keys it is given
at start (an admin key, API keys), so a deployment that ships an empty value or the
placeholder of an example file fails at start instead of running open.

Owns the rule only; which setting holds a key, and what a service does without one, is
the service's (its settings class).
"""

from __future__ import annotations

import re

ADMIN_KEY_MIN_CHARS = 32  # `secrets.token_urlsafe(32)` gives 43; 32 leaves no guessable key
# clients' API keys: the same bar (`lorastack gateway keys add` makes 46 characters); a
# shorter key may be guessed by anyone who reaches the API, so there is no override
API_KEY_MIN_CHARS = ADMIN_KEY_MIN_CHARS
# the values example files and tutorials ship, compared lowercased without punctuation
PLACEHOLDERS = frozenset(
    {
        "replaceme", "changeme", "changeit", "changethis", "secret", "password", "passwd",
        "admin", "test", "example", "todo", "fixme", "xxx", "xxxx", "placeholder", "default",
        "none", "null", "key", "apikey", "token", "yourkey", "yourapikey", "yoursecret",
        "setme", "insertkeyhere", "putyourkeyhere", "sk", "skxxx", "mykey", "mysecret",
    }
)  # fmt: skip
_HOW = 'make one with: python3 -c "import secrets; print(secrets.token_urlsafe(32))"'


def secret_problem(value: str, what: str, min_chars: int = 0) -> str:
    """Why `value` may not be used as `what` ('' when it may), with what to do instead:
    empty or blank, a known placeholder, or shorter than `min_chars`."""
    if not value.strip():
        return f"{what} is set but empty; {_HOW}, or unset it"
    if re.sub(r"[^a-z0-9]", "", value.lower()) in PLACEHOLDERS or "replace_me" in value.lower():
        return f"{what} is the placeholder {value[:16]!r}, not a secret; {_HOW}"
    if len(value) < min_chars:
        return f"{what} has {len(value)} characters, fewer than {min_chars}; {_HOW}"
    return ""
