"""The `lorastack` command lines of the docs, against the code, so the two cannot drift apart.

Every `lorastack ...` line of a fenced shell block (sh, bash, shell or console) in a README
or docs/*.md (`python -m lorastack.cli ...` under torchrun too), and every inline code span
of the prose that starts with `lorastack `, must name subcommands the `lorastack` parser has,
flags the subcommand takes, and, where a flag has choices, values among them; `--help` of
every subcommand named renders. Running the lines is tests/test_docs_shell.py's: every
shell block runs there as written, or says why not.

The docs' notation, read as such: `[...]` is optional, `A | B` are alternatives in one
place (`store ls | show | get`, `promote REF | --list`), and so are `up/down/status` in a
subcommand's place; `...` is more of the same, and a word with an upper-case letter
(CONFIG, RUN/adapter:V, DIR_OR_REF) is a placeholder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lorastack.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"sh", "bash", "shell", "console"}  # every fence says its language
SEPARATORS = {"&&", "||", ";", "&"}  # between shell commands on one line


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    words: tuple[str, ...]  # after `lorastack`, as shlex splits them

    @property
    def text(self) -> str:
        return " ".join(("lorastack", *self.words))

    @property
    def concrete(self) -> bool:
        return not any(is_notation(w) or is_placeholder(w) for w in self.words)


def doc_files() -> list[Path]:
    found = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for pattern in ("*/README.md", "*/*/README.md", "*/*/*/README.md"):
        found += sorted(p for p in REPO.glob(pattern) if not is_hidden(p))
    return sorted(set(found))


def is_hidden(path: Path) -> bool:
    parts = path.relative_to(REPO).parts
    return any(p.startswith(".") or p == "node_modules" for p in parts)


def shell_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of every fenced shell block, `\\`-continued lines joined."""
    fence: str | None = None
    pending, start = "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().split(" ")[0] if fence is None else None
            continue
        if fence is None or fence not in SHELL_FENCES:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, (pending + stripped).removeprefix("$ ")
        pending = ""


def doc_commands() -> list[DocCommand]:
    found = []
    for path in doc_files():
        for number, line in shell_lines(path):
            if "lorastack" not in line:
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unclosed quote: not a line of ours
                continue
            command: list[str] = []
            for word in [*words, ";"]:
                if word in SEPARATORS:
                    rest = after_lorastack(command)
                    if rest is not None:
                        where = f"{path.relative_to(REPO)}:{number}"
                        found.append(DocCommand(where, tuple(rest)))
                    command = []
                elif command or not re.fullmatch(r"\w+=\S*", word):  # env assignments
                    command.append(word)
    return found


def after_lorastack(command: list[str]) -> list[str] | None:
    """The words after `lorastack` (or after torchrun's `-m lorastack.cli`), else None."""
    if command and Path(command[0]).name == "lorastack":
        return command[1:]
    if "lorastack.cli" in command and command[command.index("lorastack.cli") - 1] == "-m":
        return command[command.index("lorastack.cli") + 1 :]
    return None


def inline_commands() -> list[DocCommand]:
    """The prose's inline code spans that start with `lorastack ` (checked, never run)."""
    found = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for span in re.finditer(r"(?<!`)`(lorastack [^`\n]+)`(?!`)", text):
            try:
                words = shlex.split(span[1])
            except ValueError:
                continue
            number = text.count("\n", 0, span.start()) + 1
            found.append(DocCommand(f"{path.relative_to(REPO)}:{number}", tuple(words[1:])))
    return found


def is_notation(word: str) -> bool:
    return word == "|" or "[" in word or "..." in word or "…" in word


def is_placeholder(word: str) -> bool:
    return bool(re.search(r"[A-Z$<]", word))


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def alternatives(words: tuple[str, ...]) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    for word in words:
        if word == "|":
            groups.append([])
        else:
            groups[-1].append(word)
    return groups


def check(command: DocCommand, root: argparse.ArgumentParser) -> tuple[list[str], set[str]]:
    """(what the parser does not know, the subcommand paths named) of one doc command."""
    problems: list[str] = []
    paths: set[str] = set()
    first, *others = alternatives(command.words)
    trail = [("", root)]  # (path, parser) from the root to the deepest subcommand named
    rest = walk(first, trail, problems)
    flags(rest, trail[-1][1], problems)
    paths.add(trail[-1][0])
    for alt in others:
        if not alt or alt[0] in ("...", "…"):
            continue
        if alt[0].startswith("-"):  # another flag of the same subcommand: `REF | --list`
            flags(alt, trail[-1][1], problems)
            continue
        # another subcommand in the last one's place: `store ls | show | get`
        alt_trail = trail[:-1] if len(trail) > 1 else trail
        rest = walk(alt, alt_trail, problems)
        flags(rest, alt_trail[-1][1], problems)
        paths.add(alt_trail[-1][0])
    return [f"{command.where}: `{command.text}`: {p}" for p in problems], paths


def walk(
    words: list[str], trail: list[tuple[str, argparse.ArgumentParser]], problems: list[str]
) -> list[str]:
    """Descend `trail` (in place) by the subcommand words; the words after them."""
    for i, word in enumerate(words):
        path, parser = trail[-1]
        choices = subparsers(parser)
        if choices and is_placeholder(word):  # `lorastack <command> --check`: any command
            return []
        if not choices or word.startswith("-") or is_notation(word):
            return words[i:]
        named = word.split("/")  # `up/down/status`: each in this place
        unknown = [w for w in named if w not in choices]
        if unknown:
            where = f"lorastack {path}".strip()
            problems.append(f"`{where}` has no subcommand {unknown} (it has {sorted(choices)})")
            return []
        trail.append((f"{path} {named[0]}".strip(), choices[named[0]]))
    return []


def flags(words: list[str], parser: argparse.ArgumentParser, problems: list[str]) -> None:
    known = options(parser)
    for i, word in enumerate(words):
        name = word.strip("[]").split("=")[0]
        if not re.fullmatch(r"--?[a-z][\w-]*", name):
            continue
        action = known.get(name)
        if action is None:
            problems.append(f"no flag {name} (it has {sorted(known)})")
            continue
        value = word.split("=", 1)[1] if "=" in word else None
        if value is None and i + 1 < len(words) and action.nargs != 0:
            value = words[i + 1]
        if action.choices is None or value is None or is_placeholder(value):
            continue
        for choice in value.strip("[]").split("|"):
            try:  # the choices are of the flag's type (--max-lora-rank: int)
                typed = action.type(choice) if callable(action.type) else choice
            except ValueError:
                typed = choice
            if choice and typed not in action.choices:
                problems.append(f"{name} {choice!r} is not one of {sorted(action.choices)}")


COMMANDS = doc_commands()
INLINE = inline_commands()


def test_the_docs_name_lorastack_commands() -> None:
    # the extraction found them (50 lines in shell blocks, 150 spans in the prose)
    assert len(COMMANDS) > 40 and len(INLINE) > 100, (len(COMMANDS), len(INLINE))


def test_every_subcommand_flag_and_choice_in_the_docs_exists() -> None:
    root = build_parser()
    problems: list[str] = []
    paths: set[str] = set()
    for command in COMMANDS + INLINE:
        found, named = check(command, root)
        problems += found
        paths |= named
    assert not problems, "\n".join(problems)
    # and each subcommand named renders its --help
    for path in sorted(paths):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            build_parser().parse_args([*path.split(), "--help"])
        assert done.value.code == 0 and "usage: lorastack" in out.getvalue(), path
