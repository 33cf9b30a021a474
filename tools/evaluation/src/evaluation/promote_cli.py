"""`lorastack promote`: flags to `evaluation.promotion`, the outcome to the terminal.

lorastack promote RUN/adapter[:V]                     on an improvement verdict only
lorastack promote RUN/adapter:V --force --reason WHY  anyway; the reason is recorded
lorastack promote --list [PREFIX]                     labels in force
"""

from __future__ import annotations

import argparse
from typing import Any

from lorastack.settings import CommonSettings
from lorastack.store import LabelRecord
from lorastack.subcommands import add_command


def cmd_promote(args: argparse.Namespace) -> int:
    """label an adapter NAME@promoted, only on an improvement verdict

    Point NAME@LABEL (default NAME@promoted) at an adapter version when its published
    evaluation (lorastack eval --adapter REF) says 'improvement' on the primary metric;
    otherwise refuse with the numbers. Serve configs that name NAME@promoted follow the label
    without a restart.
    """
    from evaluation.promotion import promote
    from lorastack.errors import ConfigError
    from lorastack.manifest import served_label_name
    from lorastack.store import open_store

    store = open_store(CommonSettings())
    if args.list:
        return print_labels(store.labels(args.ref or ""), store.url)
    if not args.ref:
        raise ConfigError("name the adapter to promote", "lorastack promote RUN/adapter[:VERSION]")
    done = promote(
        store,
        args.ref,
        label=args.label,
        force=args.force,
        reason=args.reason or "",
        report_ref=args.report,
    )
    rec = done.record
    print(f"{rec.ref} -> {rec.target} (move {rec.seq}, by {rec.by}, {rec.created})")
    if done.evidence is not None:
        print(f"evidence: {done.evidence.report.ref}: {done.evidence.numbers()}")
    if rec.forced:
        print(f"FORCED: {rec.reason}")
    print(
        f"serve it: adapters: [{rec.ref}] in serve.yaml (served as "
        f"{served_label_name(rec.name, rec.label)}; a running server follows the label)"
    )
    return 0


def print_labels(records: list[LabelRecord], url: str) -> int:
    """Print one line per label record (or that there are none); returns exit code 0."""
    if not records:
        print(f"(no labels in {url})")
    for r in records:
        print(r.line())
    return 0


def register(sub: Any) -> None:
    p = add_command(sub, "promote", cmd_promote)
    p.add_argument("ref", nargs="?", metavar="RUN/adapter[:VERSION]")
    p.add_argument("--label", default="promoted", help="label to move (default: promoted)")
    p.add_argument("--report", metavar="NAME[:VERSION]", help="the evaluation that decides")
    p.add_argument("--force", action="store_true", help="promote without an improvement")
    p.add_argument("--reason", help="why (required with --force; recorded)")
    p.add_argument("--list", action="store_true", help="list labels in force (REF: a prefix)")
