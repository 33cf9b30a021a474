"""The pages the docs tests read, their fenced blocks, and the marker that says how a block
of shell is tested.

The pages: README.md, docs/*.md and the READMEs under docs/ (not the example outputs there),
and each package's README (libs/, services/, apps/, tools/, deploy/). bench/ READMEs are
measurement recipes for the machines they name: tests/test_docs_commands.py checks their
`lorastack` lines, nothing here runs them.

A shell block (```sh, bash, shell or console) is run by tests/test_docs_shell.py as written,
unless the line just above its fence says why not:

    <!-- docs-test: needs docker -->      needs what the word names (NEEDS; several: "docker, gpu")
    <!-- docs-test: synopsis -->          the forms of a command, with placeholders (CONFIG, ...)

A marked block is checked as far as it can be (its subcommands and flags, the configs it
names, `--check`, make targets, compose services, paths, endpoints). Every other fence says
its language (```text for a diagram or an answer), so no shell can hide in an unlabelled one.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL = {"sh", "bash", "shell", "console"}
# What a marked block needs that a test here does not have, and where it is run instead.
NEEDS = {
    "gpu": "an NVIDIA GPU and CUDA vLLM (bench/ runs these on one)",
    "docker": "Docker and the stack's images (make test-compose walks the compose path)",
    "cluster": "a Kubernetes cluster (tests/test_k8s_*.py render and --check every target)",
    "stack": "vLLM and the gateway running (tests/test_e2e_pipeline.py runs make demo's)",
    "minutes": "minutes of CPU: training, merging (make demo runs these stages, and "
    "tests/test_e2e_pipeline.py runs make demo)",
    "server": "it starts a server that runs until stopped (its service's tests start it)",
    "root": "root on the machine (apt-get, services)",
    "network": "the network (git clone, a model hub)",
    "user-data": "the reader's own files or secrets",
}
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    lines: tuple[tuple[int, str], ...]  # (line number, text) inside the fence
    marker: str | None  # the docs-test comment's text above the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def needs(self) -> list[str]:
        if not self.marker or not self.marker.startswith("needs "):
            return []
        return [w.strip() for w in self.marker.removeprefix("needs ").split(",")]

    @property
    def runs(self) -> bool:
        return self.lang in SHELL and self.marker is None


@dataclass(frozen=True)
class Command:
    """One command of a shell block: continuation lines joined, the prompt and the trailing
    comment kept apart; for a console block, the output lines the page shows after it."""

    where: str  # page:line
    text: str  # as a shell reads it (no `$ `), comments included
    output: tuple[str, ...] = ()

    @property
    def words(self) -> list[str]:
        try:
            return shlex.split(self.text, comments=True)
        except ValueError:
            return self.text.split()


def pages() -> list[Path]:
    found = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found += sorted((REPO / "docs").glob("*/*/README.md"))  # not the examples' outputs
    for layer in ("libs", "services", "apps", "tools"):
        found += sorted(REPO.glob(f"{layer}/*/README.md"))
    found += sorted(p for p in (REPO / "deploy").rglob("README.md"))
    return found


@cache
def blocks(page: Path) -> tuple[Block, ...]:
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    start, lang, inside, indent = 0, "", False, 0
    body: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if not inside:
                start, lang, inside, body = number, stripped[3:].strip(), True, []
                indent = len(line) - len(line.lstrip())
            else:
                above = lines[start - 2].strip() if start >= 2 else ""
                marker = MARKER.fullmatch(above)
                out.append(Block(page, start, lang, tuple(body), marker[1] if marker else None))
                inside = False
            continue
        if inside:
            keep = not indent or line[:indent].isspace()
            body.append((number, line[indent:] if keep else line.lstrip()))
    return tuple(out)


def shell_blocks() -> Iterator[Block]:
    for page in pages():
        yield from (b for b in blocks(page) if b.lang in SHELL)


def commands(block: Block) -> list[Command]:
    """The block's commands; comment-only lines are prose, and in a console block a line
    without `$ ` is output of the command above it."""
    out: list[Command] = []
    pending, start = "", 0
    where = str(block.page.relative_to(REPO))
    for number, line in block.lines:
        text = line.rstrip()
        if block.lang == "console" and not pending:
            if not text.startswith("$ "):
                if out and text:
                    last = out[-1]
                    out[-1] = Command(last.where, last.text, (*last.output, text))
                continue
            text = text[2:]
        if not pending and (not text.strip() or text.lstrip().startswith("#")):
            continue
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        if open_quote(pending + text.strip()):  # a quoted argument goes on below
            pending += text.strip() + "\n"
            continue
        out.append(Command(f"{where}:{start}", (pending + text.strip())))
        pending = ""
    return out


def open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


def split_commands(words: list[str]) -> Iterator[list[str]]:
    """The simple commands of a line's words (split at &&, ||, ;, & and |), leading
    variable assignments dropped."""
    command: list[str] = []
    for word in [*words, ";"]:
        if word in {"&&", "||", ";", "&", "|"}:
            if command:
                yield command
            command = []
        elif command or not re.fullmatch(r"[A-Za-z_]\w*=\S*", word):
            command.append(word)
