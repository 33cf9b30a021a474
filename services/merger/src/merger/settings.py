"""The merger's one settings class, built once at start (CLI handler or job entry point).

Environment variables carry the `LORASTACK_` prefix, e.g. `LORASTACK_MERGE_DEVICE=cpu`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from lorastack.serving import check_max_lora_rank
from lorastack.settings import CommonSettings


class MergerSettings(CommonSettings):
    """The merger's one settings class: merge folder, device and verification sizes."""

    merge_dir: Path | None = Field(
        None, description="where merged folders are written before publishing; default HOME/merges"
    )
    merge_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="where deltas are applied and verification runs; auto: the GPU if any"
    )
    merge_probe_new_tokens: int = Field(
        24, ge=1, le=512, description="tokens generated greedily per probe during verification"
    )
    max_lora_rank: int = Field(
        16, description="the serving vLLM's --max-lora-rank, for check-adapter"
    )

    @field_validator("merge_dir")
    @classmethod
    def _expand_dir(cls, v: Path | None) -> Path | None:
        return v.expanduser().resolve() if v is not None else None

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        return check_max_lora_rank(v)

    @property
    def resolved_merge_dir(self) -> Path:
        return self.merge_dir or self.home / "merges"
