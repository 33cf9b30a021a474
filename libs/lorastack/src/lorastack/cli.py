"""The `lorastack` command: argument parsing and the one place errors become exit codes.

Each service contributes its subcommands through `register(subparsers)` in its own
`cli` module; a service that is not installed (the gateway image has no trainer) is
simply absent. Handlers take the parsed arguments and return an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lorastack.errors import LorastackError

SERVICE_CLIS = ("lorastack.store_cli", "trainer.cli", "merger.cli", "inference.cli", "gateway.cli")
OPTIONAL_CLIS = (
    "lorastack.pipeline",
    "lorastack.doctor",
    "lorastack.local_stack",
    "lorastack.evaluation.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorastack",
        description="From a chat dataset to a served, checked LoRA model.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SERVICE_CLIS + OPTIONAL_CLIS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # that service is not installed in this image
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    from lorastack.log import setup_logging

    setup_logging(args.log_level)
    try:
        code: int = args.handler(args)
    except LorastackError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
