"""How a package declares a `lorastack` subcommand, and the flags several commands share.

Owns `add_command`, a subcommand's parser run by one handler: what the command does is
said once, in the handler's docstring, which is both the help line of `lorastack --help`
(its first paragraph) and the description of `lorastack NAME --help` (the rest). Owns too
the flags more than one command takes, each declared once: `--check` (build what a start
builds, check it, stop) and `--json` (the result as JSON instead of lines for people). A
command keeps its own words for what its `--check` checks.

Does not own: finding the subcommands, running them and mapping their errors to exit codes
(`lorastack.cli`); what `--check` checks (`lorastack.check_mode`); any flag only one
command takes; a group of subcommands that runs none itself (`lorastack cost`), which is
argparse's own `add_parser`.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

Handler = Callable[[argparse.Namespace], int]  # the parsed arguments -> the exit code


def add_command(sub: Any, name: str, handler: Handler, **options: Any) -> argparse.ArgumentParser:
    """Add subcommand `name` to `sub` (argparse's subparsers), run by `handler`.

    The help line is the first paragraph of the handler's docstring and the description the
    paragraphs after it (none: no description); `options` go to argparse's `add_parser` as
    they are (a `formatter_class`). Returns the parser, for the command's own arguments."""
    summary, _, details = (inspect.getdoc(handler) or "").partition("\n\n")
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=" ".join(summary.split()) or None, description=details or None, **options
    )
    parser.set_defaults(handler=handler)
    return parser


def add_check_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--check`: the command builds what its start builds (settings, config file, secrets),
    checks it (`lorastack.check_mode.run_check`) and stops; `help` says what it checks."""
    parser.add_argument("--check", action="store_true", help=help)


def add_json_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """`--json`: print `what` ("the report") as JSON, for a program, instead of lines for
    people."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")
