"""The gateway reads inference's serve config for one thing: which store artifact holds the
tokenizer of the model name clients send. A bad file fails at start, saying what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import _settings
from gateway.settings import GatewaySettings
from lorastack.errors import ConfigError


def _serve(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model: smollm2-135m-instruct\nserved_model_name: smollm2\n", "smollm2"),
        ("model: team/llama31-8b:3\n", "llama31-8b"),  # vLLM's default: the name's last part
    ],
)
def test_served_name_maps_to_the_models_artifact(tmp_path: Path, text: str, expected: str) -> None:
    s = GatewaySettings(serve_config=_serve(tmp_path, text))
    model = text.split("\n")[0].removeprefix("model: ")
    assert s.tokenizers == {expected: model}


def test_an_explicit_tokenizer_entry_wins(tmp_path: Path) -> None:
    path = _serve(tmp_path, "model: smollm2-135m-instruct\nserved_model_name: smollm2\n")
    s = GatewaySettings(serve_config=path, tokenizers="smollm2=/models/smollm2")
    assert s.tokenizers == {"smollm2": "/models/smollm2"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot be read"),
        ("model: [\n", "not valid YAML"),
        ("served_model_name: smollm2\n", "names no model"),
        ("model: ../up\n", "invalid artifact name"),
    ],
)
def test_a_bad_serve_config_is_refused_with_the_reason(
    tmp_path: Path, text: str | None, message: str
) -> None:
    path = tmp_path / "serve.yaml" if text is None else _serve(tmp_path, text)
    with pytest.raises(ValidationError, match=message):
        GatewaySettings(serve_config=path)


A, B = "http://vllm-a:8000", "http://vllm-b:8000"


@pytest.mark.parametrize(
    ("serve", "given", "expected"),
    [
        (None, "", {}),  # unknown: routing sees the queues only
        (None, f"{A}/v1=1,{B}/=8", {A: 1, B: 8}),  # URLs as the backends list normalises them
        (None, f'{{"{A}": 4}}', {A: 4}),
        ("model: m\nmax_num_seqs: 16\n", "", {A: 16, B: 16}),  # the serve config's, for all
        ("model: m\n", f"{B}=2", {A: 8, B: 2}),  # inference's default 8; an entry wins
    ],
)
def test_max_num_seqs_per_backend(
    tmp_path: Path, serve: str | None, given: str, expected: dict[str, int]
) -> None:
    config = None if serve is None else _serve(tmp_path, serve)
    s = GatewaySettings(backends=[A, B], backend_max_num_seqs=given, serve_config=config)
    assert s.backend_max_num_seqs == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("http://elsewhere:8000=4", "not backends"),
        (f"{A}=0", ">= 1"),
        (f"{A}", "url=N"),
    ],
)
def test_bad_max_num_seqs_is_refused(given: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GatewaySettings(backends=[A, B], backend_max_num_seqs=given)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("http://elsewhere:8000=2", "not backends"),
        (f"{A}=0", "> 0"),
        (f"{A}", "url=W"),
    ],
)
def test_bad_backend_weights_are_refused(given: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GatewaySettings(backends=[A, B], backend_weights=given)


def test_backend_weights_are_read_per_url() -> None:
    s = GatewaySettings(backends=[A, B], backend_weights=f"{A}/=2.5")
    assert s.backend_weights == {A: 2.5}
    with pytest.raises(ValidationError, match="backends_dns"):
        GatewaySettings(backends_dns="vllm:8000", backend_weights={A: 2})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"backends": ["ftp://x"]},
            "gateway setting backends: backend 'ftp://x' must start with http:// or https://",
        ),
        ({"api_keys_file": "/no/such/keys"}, "gateway settings: api_keys_file /no/such/keys does"),
    ],
)
def test_a_bad_setting_at_start_is_a_config_error_naming_it(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        _settings(**overrides)
    assert e.value.message.startswith(message)
    assert "Value error" not in e.value.message
