"""`read_yaml_mapping`: the run, serve and eval configs are read with the same errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastack.errors import ConfigError
from lorastack.settings import read_yaml_mapping


def test_a_mapping_is_read_and_an_empty_file_is_an_empty_one(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("model: m\nport: 8000\n")
    (tmp_path / "empty.yaml").write_text("")
    assert read_yaml_mapping(tmp_path / "a.yaml", "serve config", "") == {
        "model": "m",
        "port": 8000,
    }
    assert read_yaml_mapping(tmp_path / "empty.yaml", "serve config", "") == {}


@pytest.mark.parametrize(
    ("name", "content", "message", "hint"),
    [
        ("missing.yaml", None, "serve config {p} does not exist", "give the path"),
        ("folder", "", "serve config {p} does not exist", "give the path"),  # a directory
        ("bad.yaml", "model: [\n", "{p} is not valid YAML", "fix the YAML syntax"),
        ("latin1.yaml", b"model: caf\xe9\n", "{p} is not valid YAML", "fix the YAML syntax"),
        ("list.yaml", "- model\n", "{p} must hold a mapping", "e.g. 'model: NAME'"),
    ],
)
def test_what_is_wrong_with_the_file_is_a_config_error(
    tmp_path: Path, name: str, content: str | bytes | None, message: str, hint: str
) -> None:
    p = tmp_path / name
    if name == "folder":
        p.mkdir()
    elif isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    with pytest.raises(ConfigError) as e:
        read_yaml_mapping(p, "serve config", "e.g. 'model: NAME'")
    assert e.value.message.startswith(message.format(p=p))
    assert e.value.hint.startswith(hint)
