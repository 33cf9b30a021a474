"""The `lorastack` command host: finds the subcommands, parses, maps errors to exit codes.

The core owns no subcommand. Every package that has some (each service, the `lorastack`
app, the evaluation tools) declares a `register(subparsers)` function under the entry-point
group `lorastack.commands` in its pyproject.toml; a package that is not installed (the
gateway image has no trainer) is simply absent. Handlers take the parsed arguments and
return an exit code. The host stays in the core so that every image has the same
`lorastack <command>` entry point and `python -m lorastack.cli` (torchrun) works.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points

from lorastack.errors import LorastackError

GROUP = "lorastack.commands"
# `lorastack --help` lists the commands in the order of the path; others follow by name
ORDER = (
    "store",
    "trainer",
    "merger",
    "inference",
    "gateway",
    "demo",
    "doctor",
    "stack",
    "evaluation",
)


# Our packages that an image may leave out; a command that needs one of them is absent there.
INSTALLABLE = frozenset({"trainer", "merger", "inference", "gateway", "evaluation"})


def build_parser() -> argparse.ArgumentParser:
    """The `lorastack` parser, with the subcommands every installed package registers."""
    parser = argparse.ArgumentParser(
        prog="lorastack",
        description="From a chat dataset to a served, checked LoRA model.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    rank = {name: i for i, name in enumerate(ORDER)}
    for name in sorted(found, key=lambda n: (rank.get(n, len(ORDER)), n)):
        try:
            register = found[name].load()
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in INSTALLABLE:
                continue  # needs a package this image leaves out (`stack` in the trainer's)
            raise
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; its exit code (errors mapped to codes)."""
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


def entry() -> None:
    """The console script: main(), then the process ends without tearing its interpreter
    down (freeing every module and tensor one by one takes seconds after a training, for
    nothing the OS would not do; bench/trainer/README.md has the figures). The atexit
    handlers still run and the output is flushed; while a thread that is not a daemon is
    alive it exits as usual."""
    code = main()
    main_thread = threading.main_thread()
    if any(not t.daemon for t in threading.enumerate() if t is not main_thread):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or a broken pipe
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
