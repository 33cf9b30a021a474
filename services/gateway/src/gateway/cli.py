"""`lorastack gateway [--workers N]`: run the OpenAI-compatible gateway with uvicorn (one
process, or N worker processes on one port: `processes.py`);
`lorastack gateway keys add|list|revoke`: manage the keys file (`keys.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, field_errors
from lorastack.subcommands import add_check_flag, add_command


def _settings(**overrides: Any) -> Any:
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    try:
        return GatewaySettings(**overrides)
    except ValidationError as e:
        field, what = field_errors(e)[0]
        raise ConfigError(
            f"gateway setting {field}: {what}" if field else f"gateway settings: {what}",
            "fix the LORASTACK_* environment variable or the command-line flag",
        ) from None


def cmd_gateway(args: argparse.Namespace) -> int:
    """run the OpenAI-compatible gateway in front of vLLM"""
    import uvicorn

    from gateway.main import create_app
    from gateway.processes import serve, uvicorn_options

    overrides: dict[str, Any] = {}
    if args.port is not None:
        overrides["port"] = args.port
    if args.host is not None:
        overrides["host"] = args.host
    if args.backend:
        overrides["backends"] = args.backend
    if args.workers is not None:
        overrides["workers"] = args.workers
    settings = _settings(**overrides)
    if args.check:  # the settings as a start builds them; nothing listens
        from lorastack.check_mode import run_check

        return run_check("gateway", settings, workers=settings.workers)
    if settings.workers > 1:
        return serve(settings)  # N processes on the port, state shared (`processes.py`)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, **uvicorn_options(settings))
    return 0


def _settings_path() -> Path | None:
    """`keys_file` from the environment, without the check that it exists."""
    from pydantic_settings import BaseSettings, SettingsConfigDict

    from gateway.settings import GatewaySettings

    class KeysFileOnly(BaseSettings):
        model_config = SettingsConfigDict(
            env_prefix=GatewaySettings.model_config.get("env_prefix", ""), extra="ignore"
        )
        keys_file: Path | None = None

    return KeysFileOnly().keys_file


def cmd_keys(args: argparse.Namespace) -> int:
    from gateway.keys import KeyEntry, KeysFile, hash_secret, load_keys, new_secret, save_keys

    path = Path(args.file) if args.file else _settings_path()
    if path is None:
        raise ConfigError("no keys file named", "pass --file PATH or set LORASTACK_KEYS_FILE")
    keys = load_keys(path) if path.exists() else KeysFile()
    if args.command_keys == "list":
        print(f"{'name':20} {'models':30} {'req/min':>8} {'tok/min':>8} {'budget':>14}")
        for k in keys.keys:
            models = ",".join(k.models) if k.models is not None else "*"
            budget = f"{k.budget_tokens}/{k.budget_period}" if k.budget_tokens else "-"
            rpm, tpm = k.requests_per_min or "-", k.tokens_per_min or "-"
            print(f"{k.name:20} {models:30} {rpm:>8} {tpm:>8} {budget:>14}")
        return 0
    if args.command_keys == "revoke":
        kept = [k for k in keys.keys if k.name != args.name]
        if len(kept) == len(keys.keys):
            names = ", ".join(k.name for k in keys.keys) or "none"
            raise ConfigError(f"no key named {args.name!r} in {path}", f"its keys: {names}")
        save_keys(path, KeysFile(keys=kept))
        print(f"revoked {args.name!r}; the gateway drops it within a second")
        return 0
    if any(k.name == args.name for k in keys.keys):
        raise ConfigError(f"a key named {args.name!r} exists", "revoke it first or pick a new name")
    secret = new_secret()
    allowed = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    try:
        entry = KeyEntry(
            name=args.name,
            sha256=hash_secret(secret),
            models=allowed,
            requests_per_min=args.requests_per_min,
            tokens_per_min=args.tokens_per_min,
            budget_tokens=args.budget_tokens,
            budget_period=args.budget_period,
        )
    except ValueError as e:
        raise ConfigError(f"key {args.name!r}: {e}", "fix the flag") from None
    save_keys(path, KeysFile(keys=[*keys.keys, entry]))
    print(f"added {args.name!r} to {path}. Its secret, shown this once (only its hash is kept):")
    print(secret)
    return 0


def register(sub: Any) -> None:
    p = add_command(sub, "gateway", cmd_gateway)
    p.add_argument("--port", type=int, default=None, help="default 8080 (LORASTACK_PORT)")
    p.add_argument("--host", default=None, help="default 127.0.0.1 (LORASTACK_HOST)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="a vLLM base URL; repeat for replicas (default LORASTACK_BACKENDS)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes on the port, about one core each (default 1, LORASTACK_WORKERS);"
        " KV admission stays exact across them; per-key limits then need LORASTACK_REDIS_URL",
    )
    add_check_flag(p, "check the settings and secrets as a start would, then stop (exit 0: ok)")
    keys = p.add_subparsers(dest="gateway_command", metavar="{keys}").add_parser(
        "keys", help="manage the keys file (LORASTACK_KEYS_FILE or --file)"
    )
    ksub = keys.add_subparsers(dest="command_keys", metavar="{add,list,revoke}", required=True)
    add = ksub.add_parser("add", help="add a named key; prints its secret once")
    add.add_argument("name")
    add.add_argument("--models", help="comma list of models/adapters it may use (default all)")
    add.add_argument("--requests-per-min", type=int, default=0, help="0: the gateway default")
    add.add_argument("--tokens-per-min", type=int, default=0, help="0: the gateway default")
    add.add_argument("--budget-tokens", type=int, default=0, help="per period; 0: no budget")
    add.add_argument("--budget-period", default="day", choices=["hour", "day", "week", "month"])
    ksub.add_parser("list", help="names, models, limits (never secrets)")
    revoke = ksub.add_parser("revoke", help="remove a key by name")
    revoke.add_argument("name")
    for q in (add, ksub.choices["list"], revoke):
        q.add_argument("--file", help="the keys file (default LORASTACK_KEYS_FILE)")
        q.set_defaults(handler=cmd_keys)
