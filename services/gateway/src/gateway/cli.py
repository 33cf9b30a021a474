"""`lorastack gateway`: run the OpenAI-compatible gateway with uvicorn (one worker)."""

from __future__ import annotations

import argparse
from typing import Any

from lorastack.errors import ConfigError


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from gateway.main import create_app
    from gateway.settings import GatewaySettings

    overrides: dict[str, Any] = {}
    if args.port is not None:
        overrides["port"] = args.port
    if args.host is not None:
        overrides["host"] = args.host
    if args.backend:
        overrides["backends"] = args.backend
    try:
        settings = GatewaySettings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(
            f"gateway setting {'.'.join(str(p) for p in err['loc'])}: {err['msg']}",
            "fix the LORASTACK_* environment variable or the command-line flag",
        ) from None
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",  # named, not "auto": a missing package fails here instead of
        http="httptools",  # silently falling back to asyncio + h11 (several times slower)
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway in front of vLLM")
    p.add_argument("--port", type=int, default=None, help="default 8080 (LORASTACK_PORT)")
    p.add_argument("--host", default=None, help="default 127.0.0.1 (LORASTACK_HOST)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="a vLLM base URL; repeat for replicas (default LORASTACK_BACKENDS)",
    )
    p.set_defaults(handler=cmd_gateway)
