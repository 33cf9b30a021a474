"""vLLM's --api-key: given to vLLM through its environment (never its command line, which
/status and `ps` show), and refused at start when it is short enough to guess. That vLLM
then answers 401 to a container without the key, on completions and load_lora_adapter, is
shown for real by the compose walk (deploy/tests/test_compose_walk.py)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

import pytest

from inference.engine import EngineSpec, VllmServer
from inference.settings import MIN_KEY_CHARS, build_settings
from lorastack.errors import ConfigError


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_key_reaches_vllm_through_its_environment_only(
    tmp_path: Path, platform: Literal["cpu", "cuda"]
) -> None:
    key = secrets.token_urlsafe(32)
    s = VllmServer(EngineSpec(model_dir=tmp_path, served_name="m", port=1, workdir=tmp_path,
                              enable_lora=True, platform=platform, api_key=key))  # fmt: skip
    assert s.environment()["VLLM_API_KEY"] == key
    assert not [a for a in s.command() if key in a]
    assert "--api-key" not in s.command()


def test_without_a_key_none_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    s = VllmServer(
        EngineSpec(model_dir=tmp_path, served_name="m", port=1, workdir=tmp_path, platform="cpu")
    )
    assert "VLLM_API_KEY" not in s.environment()


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "is set but empty"),
        (" " * 40, "is set but empty"),
        ("changeme", "is the placeholder"),
        ("REPLACE_ME_with_a_key_of_at_least_32_characters", "is the placeholder"),
        ("x" * (MIN_KEY_CHARS - 1), f"has {MIN_KEY_CHARS - 1} characters, fewer than 32"),
    ],
)
def test_a_short_blank_or_placeholder_key_is_refused_at_start(
    key: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LORASTACK_VLLM_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=f"vllm_api_key {why}"):
        build_settings(model="m", vllm_api_key=key)


def test_a_generated_key_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORASTACK_VLLM_API_KEY", raising=False)
    key = secrets.token_urlsafe(32)
    settings = build_settings(model="m", vllm_api_key=key)
    assert settings.vllm_api_key is not None
    assert settings.vllm_api_key.get_secret_value() == key
