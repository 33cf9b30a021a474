"""`python fake_serve.py CONFIG`: the real supervisor app of a serve config with the fake
vLLM (`lorastack_testing.fake_engine`) as its engine, as a process of its own, so a test can
SIGKILL a replica and start it again."""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from inference.main import create_app
from inference.settings import load_serve_config
from lorastack_testing.fake_engine import FakeEngine

if __name__ == "__main__":
    settings = load_serve_config(Path(sys.argv[1]))
    app = create_app(settings, server_factory=FakeEngine)
    uvicorn.run(
        app, host=settings.supervisor_host, port=settings.supervisor_port, log_level="warning"
    )
