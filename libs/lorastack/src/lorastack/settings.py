"""Settings every service shares: where lorastack keeps its files and its store.

Each service defines one settings class that inherits from `CommonSettings`; it is
built once at start (from the environment, prefix `LORASTACK_`) and passed down.
Nothing else in the code base reads the environment. `child_env` goes the other way: the
environment that gives a child process's settings class the values a parent chose.
`read_yaml_mapping` reads a config file (run, serve, eval) with the errors every service gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, TypeAdapter, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lorastack.errors import ConfigError


class CommonSettings(BaseSettings):
    """Settings every service shares (LORASTACK_*): the home folder, the store and the cache."""

    model_config = SettingsConfigDict(env_prefix="LORASTACK_", extra="ignore")

    home: Path = Field(
        Path("~/.lorastack"), description="root of the local store, caches, runs and logs"
    )
    store_url: str = Field(
        "", description="file:///DIR or s3://BUCKET[/PREFIX]; default file://HOME/store"
    )
    cache_dir: Path | None = Field(None, description="verified download cache; default HOME/cache")
    s3_endpoint_url: str | None = Field(None, description="e.g. http://minio:9000; None = AWS")
    s3_region: str = "us-east-1"
    s3_access_key_id: SecretStr | None = None
    s3_secret_access_key: SecretStr | None = None
    s3_max_attempts: int = Field(
        5, ge=1, le=20, description="tries per S3 call on transient errors"
    )
    s3_multipart_mb: int = Field(16, ge=5, le=5000, description="multipart threshold and part size")
    torch_threads: int = Field(0, ge=0, description="CPU threads for torch; 0 = all cores")

    @field_validator("home", "cache_dir")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser().resolve() if v is not None else None

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or f"file://{self.home / 'store'}"

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or self.home / "cache"


def child_env(settings_cls: type[BaseSettings], **values: Any) -> dict[str, str]:
    """Environment variables that make `settings_cls()` in a child process hold `values`.

    Names are the class's field names (a field renamed in a service fails here, in the
    parent, not as a silently ignored variable in the child); each value is checked against
    the field's type and limits. Lists and mappings are written as JSON, which every
    settings class of lorastack reads. None is left out, so the child keeps its default
    (JSON's "null" would be read as the text "null", e.g. cache_dir=./null); a field whose
    default is not None cannot be unset that way and is refused."""
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    env: dict[str, str] = {}
    for name, value in values.items():
        field = settings_cls.model_fields.get(name)
        if field is None:
            raise ConfigError(
                f"{settings_cls.__name__} has no setting {name!r}",
                f"use one of: {', '.join(sorted(settings_cls.model_fields))}",
            )
        kind: Any = field.annotation
        if field.metadata:
            kind = Annotated[(kind, *field.metadata)]
        try:
            TypeAdapter(kind).validate_python(value)
        except ValidationError as e:
            raise ConfigError(
                f"{settings_cls.__name__}.{name} = {value!r} is invalid: {e.errors()[0]['msg']}",
                "pass a value the service accepts",
            ) from e
        if value is None:
            if field.get_default(call_default_factory=True) is not None:
                raise ConfigError(
                    f"{settings_cls.__name__}.{name} = None cannot reach the child: its "
                    f"default is {field.get_default(call_default_factory=True)!r}, and an "
                    "unset variable means that default",
                    "pass the value the child should use",
                )
            continue  # unset: the child's default, None
        if isinstance(value, str | Path):
            text = str(value)
        elif isinstance(value, SecretStr):
            text = value.get_secret_value()
        else:
            text = json.dumps(value)
        env[f"{prefix}{name}".upper()] = text
    return env


def read_yaml_mapping(path: Path, what: str, hint: str) -> dict[str, Any]:
    """The mapping of a YAML config file (`what`: "serve config", ...); a missing or unreadable
    file, bad YAML or anything but a mapping is a ConfigError (`hint` says what to write)."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist", "give the path of a YAML file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise ConfigError(
            f"{what} {path} cannot be read: {e.strerror}", "check its permissions"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid YAML: {e}", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping (key: value lines)", hint)
    return data
