"""`lorastack.subcommands`: a command's help comes from its handler's docstring, and every
installed command has a help line."""

from __future__ import annotations

import argparse

from lorastack.cli import build_parser
from lorastack.subcommands import add_check_flag, add_command, add_json_flag


def cmd_example(args: argparse.Namespace) -> int:
    """do the example thing,
    in two lines

    What it does, at length: the first paragraph
    above is the help line.

    A second paragraph.
    """
    return 0


def cmd_terse(args: argparse.Namespace) -> int:
    """only a help line"""
    return 3


def _parser() -> tuple[
    argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]
]:
    parser = argparse.ArgumentParser(prog="lorastack")
    return parser, parser.add_subparsers(dest="command")


def test_the_docstring_is_the_help_line_and_the_description() -> None:
    parser, sub = _parser()
    p = add_command(sub, "example", cmd_example)
    add_command(sub, "terse", cmd_terse)

    listed = {a.dest: a.help for a in sub._choices_actions}
    assert listed == {"example": "do the example thing, in two lines", "terse": "only a help line"}
    assert p.description == (
        "What it does, at length: the first paragraph\nabove is the help line.\n\nA second paragraph."
    )
    assert sub.choices["terse"].description is None
    args = parser.parse_args(["terse"])
    assert args.handler(args) == 3


def test_options_reach_argparse() -> None:
    _, sub = _parser()
    p = add_command(
        sub, "example", cmd_example, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    assert "paragraph\nabove is the help line" in p.format_help()


def test_the_shared_flags() -> None:
    parser, sub = _parser()
    p = add_command(sub, "example", cmd_example)
    add_check_flag(p, "check the example as a start would, then stop")
    add_json_flag(p, "the report")

    assert parser.parse_args(["example"]).check is False
    args = parser.parse_args(["example", "--check", "--json"])
    assert args.check and args.json
    helps = {a.dest: a.help for a in p._actions}
    assert helps["check"] == "check the example as a start would, then stop"
    assert helps["json"] == "print the report as JSON"


def test_every_installed_command_has_a_help_line() -> None:
    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                for name, child in action.choices.items():
                    if not helps.get(name):
                        missing.append(f"{path} {name}")
                    missing += walk(child, f"{path} {name}")
        return missing

    assert walk(build_parser(), "lorastack") == []
