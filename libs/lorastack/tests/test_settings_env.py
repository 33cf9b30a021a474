"""`child_env`: a parent process writes the environment a child's settings class reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from lorastack.errors import ConfigError
from lorastack.settings import CommonSettings, child_env


class ChildSettings(CommonSettings):
    port: int = Field(8000, ge=1, le=65535)
    backends: list[str] = Field(default_factory=list)
    verbose: bool = False
    limit: int | None = 5


def test_the_child_reads_back_what_the_parent_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = child_env(
        ChildSettings, home=tmp_path, port=9001, backends=["http://127.0.0.1:8000"], verbose=True
    )
    assert env == {
        "LORASTACK_HOME": str(tmp_path),
        "LORASTACK_PORT": "9001",
        "LORASTACK_BACKENDS": '["http://127.0.0.1:8000"]',
        "LORASTACK_VERBOSE": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = ChildSettings()
    assert (child.home, child.port, child.backends, child.verbose) == (
        tmp_path.resolve(),
        9001,
        ["http://127.0.0.1:8000"],
        True,
    )


def test_a_renamed_setting_or_a_bad_value_fails_in_the_parent() -> None:
    with pytest.raises(ConfigError, match="no setting 'gateway_port'") as e:
        child_env(ChildSettings, gateway_port=8080)
    assert "port" in e.value.hint
    with pytest.raises(ConfigError, match=r"ChildSettings\.port = 0 is invalid"):
        child_env(ChildSettings, port=0)
    with pytest.raises(ConfigError, match="backends"):
        child_env(ChildSettings, backends="http://a")


def test_unset_values_are_left_out_not_written_as_null(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 38: None became the text "null", and a child read cache_dir = <cwd>/null
    env = child_env(ChildSettings, home=tmp_path, cache_dir=None, s3_endpoint_url=None)
    assert env == {"LORASTACK_HOME": str(tmp_path)}
    assert "null" not in env.values()
    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LORASTACK_CACHE_DIR", raising=False)
    child = ChildSettings()
    assert child.cache_dir is None and child.s3_endpoint_url is None
    assert child.resolved_cache_dir == tmp_path.resolve() / "cache"
    assert not (tmp_path / "null").exists()
    # a None that the child would read as its non-None default is refused in the parent
    with pytest.raises(ConfigError, match=r"ChildSettings\.limit = None cannot reach the child"):
        child_env(ChildSettings, limit=None)
