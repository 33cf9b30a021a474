"""The keys file: API keys as data (names, allowed models, limits, budgets), hashed at rest.

    keys:
      - name: team-a                # shown in /metrics and errors; never the secret
        sha256: 9f86d0...           # sha256 hex digest of the secret (`gateway keys add`)
        models: [smollm2, sql-lora] # models or adapters the key may use; absent = all
        requests_per_min: 60        # 0 = the gateway's default (key_requests_per_min)
        tokens_per_min: 20000       # prompt + max_tokens, refunded to usage; 0 = default
        budget_tokens: 1000000      # prompt + completion tokens per period; 0 = no budget
        budget_period: day          # hour | day | week | month, calendar periods in UTC

YAML or JSON (JSON is YAML, so one parser reads both; `save_keys` writes JSON when the
file name ends in .json). Owns: the schema, reading, atomic writing, new secrets. Does not
own: checking requests against it (`auth.py`).
"""

from __future__ import annotations

import calendar
import datetime as dt
import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lorastack.errors import ConfigError

Period = Literal["hour", "day", "week", "month"]


class KeyEntry(BaseModel):
    """One key of the keys file: its name, the sha256 of its secret, the models it may use,
    its per-minute limits and token budget (0 = none)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex digest of the secret")
    models: list[str] | None = Field(None, description="allowed model/adapter ids; None = all")
    requests_per_min: int = Field(0, ge=0)
    tokens_per_min: int = Field(0, ge=0)
    budget_tokens: int = Field(0, ge=0, description="tokens per budget_period; 0 = none")
    budget_period: Period = "day"


class KeysFile(BaseModel):
    """The keys file: a list of keys whose names and digests are each unique."""

    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        for what in ("name", "sha256"):
            seen: set[str] = set()
            for k in self.keys:
                value = getattr(k, what)
                if value in seen:
                    raise ValueError(f"two keys share the {what} {value!r}")
                seen.add(value)
        return self


def hash_secret(secret: str) -> str:
    """The hex sha256 of `secret`, as the keys file stores it."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    """A new random API key secret (`sk-` and 32 random bytes, URL-safe base64)."""
    return "sk-" + secrets.token_urlsafe(32)


def load_keys(path: Path, content: bytes | None = None) -> KeysFile:
    """The file's keys (from `content` when given: the bytes read from `path`); ConfigError
    naming the file and what to fix."""
    try:
        text = path.read_bytes() if content is None else content
        data = yaml.safe_load(text) if text.strip() else None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"keys file {path}: {e}", "fix the file (YAML or JSON)") from None
    try:
        return KeysFile.model_validate(data or {})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"keys file {path}: {where}: {err['msg']}", "fix that entry") from None


def save_keys(path: Path, keys: KeysFile) -> None:
    """Write atomically (a reader sees the old or the new file), readable by its owner only."""
    data = keys.model_dump(exclude_defaults=True)
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = yaml.safe_dump(data, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def period_end(now: float, period: Period) -> float:
    """Epoch seconds when the calendar period (UTC) holding `now` ends."""
    t = dt.datetime.fromtimestamp(now, dt.UTC)
    if period == "hour":
        start = t.replace(minute=0, second=0, microsecond=0)
        return (start + dt.timedelta(hours=1)).timestamp()
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return (day + dt.timedelta(days=1)).timestamp()
    if period == "week":  # weeks start on Monday
        return (day + dt.timedelta(days=7 - day.weekday())).timestamp()
    days = calendar.monthrange(t.year, t.month)[1]
    return (day.replace(day=1) + dt.timedelta(days=days)).timestamp()
