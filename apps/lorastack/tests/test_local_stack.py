"""`lorastack up`: each child's environment, read back by the service's own settings class."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from inference.settings import InferenceSettings
from lorastack.settings import CommonSettings
from lorastack_app.local_stack import GATEWAY_PORT, SUPERVISOR_PORT, VLLM_PORT, services


def test_children_get_the_settings_the_stack_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (VLLM_PORT, SUPERVISOR_PORT, GATEWAY_PORT) == (8000, 8001, 8080)  # the services' own
    settings = CommonSettings(home=tmp_path / "home")
    (tmp_path / "serve.yaml").write_text(
        "model: smollm2-135m-instruct\nserved_model_name: smollm2\n"
    )
    inference, gateway = services(settings, tmp_path / "serve.yaml", gateway_port=8099)
    assert inference.argv[-2:] == ["serve", str(tmp_path / "serve.yaml")]
    assert gateway.ready_url == "http://127.0.0.1:8099/ready"

    def read_back(cls: type[CommonSettings], env: dict[str, str]) -> CommonSettings:
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            return cls()

    inf = read_back(InferenceSettings, inference.env)
    assert isinstance(inf, InferenceSettings)
    assert (inf.port, inf.supervisor_port) == (VLLM_PORT, SUPERVISOR_PORT)
    gw = read_back(GatewaySettings, gateway.env)
    assert isinstance(gw, GatewaySettings)
    assert gw.port == 8099 and gw.backends == [f"http://127.0.0.1:{VLLM_PORT}"]
    # the gateway's tokenizer for the served name comes from the artifact inference serves
    assert gw.tokenizers == {"smollm2": "smollm2-135m-instruct"}
    for child in (inf, gw):
        assert child.home == settings.home
        assert child.resolved_store_url == settings.resolved_store_url
