"""`lorastack up`: each child's environment, read back by the service's own settings class."""

from __future__ import annotations

import http.server
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from inference.settings import InferenceSettings
from lorastack.errors import Refused
from lorastack.settings import CommonSettings
from lorastack_app.local_stack import (
    GATEWAY_PORT,
    SUPERVISOR_PORT,
    VLLM_PORT,
    Service,
    launch,
    services,
)


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
    assert inference.ports == (VLLM_PORT, SUPERVISOR_PORT) and gateway.ports == (8099,)

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


def test_a_port_another_process_holds_is_refused_not_taken_for_ours(tmp_path: Path) -> None:
    """An impostor on the port answers /ready 200 (another home's stack, compose): before,
    it passed for this service, and the demo talked to that stack's store. Now nothing is
    started or recorded, and the impostor is sent nothing and keeps serving."""
    settings = CommonSettings(home=tmp_path / "home")
    asked: list[str] = []

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    impostor = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    port = impostor.server_address[1]
    marker = tmp_path / "started"
    argv = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    svc = Service("gateway", argv, {}, f"http://127.0.0.1:{port}/ready", {}, (port,))
    try:
        with pytest.raises(Refused, match=f"port {port} of 127.0.0.1 is taken") as e:
            launch(settings, svc)
        assert asked == []  # the check only connects: nothing is sent to the impostor
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            assert r.status == 200  # and it serves on, untouched
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert "lorastack down" in e.value.hint and str(settings.home) in str(e.value)
    assert not (settings.home / "run" / "gateway.pid").exists() and not marker.exists()
