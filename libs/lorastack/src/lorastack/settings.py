"""Settings every service shares: where lorastack keeps its files and its store.

Each service defines one settings class that inherits from `CommonSettings`; it is
built once at start (from the environment, prefix `LORASTACK_`) and passed down.
Nothing else in the code base reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
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
