"""`lorastack data publish FILE --name NAME`: a chat JSONL file as a dataset artifact in the
store, for a run that trains where the file is not (a Kubernetes Job: `dataset.ref: NAME`).

The file goes through the same preflight as `lorastack data check` first, against the run
config it will train with (`--config`, else the trainer's defaults): a file the check
refuses is not published, and the report printed is the check's. The same bytes published
again give back the version that holds them.

Owns the command only: the preflight is the trainer's (`trainer.data.preparation.check`),
the upload the store's. A run publishes its own split under `<output>/data`; a dataset
published under that name would be mixed with it, so the name is refused (as the run
config refuses `dataset.ref: <output>/data`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError, NotFound


def cmd_publish(args: argparse.Namespace) -> int:
    """Exit 0: published (warnings printed); 3: refused by the preflight, nothing published."""
    from lorastack.manifest import parse_ref, validate_name
    from lorastack.settings import read_yaml_mapping
    from trainer.config import build_config, with_overrides
    from trainer.data.preparation import check
    from trainer.data.splits import publish_once
    from trainer.settings import TrainerSettings

    file = Path(args.file)
    if not file.is_file():
        raise NotFound(f"{file} does not exist", "give the path of a chat JSONL file")
    validate_name(args.name, "dataset name")
    data = read_yaml_mapping(Path(args.config), "run config", "") if args.config else {}
    kept = {k: v for k, v in (data.get("dataset") or {}).items() if k == "drop_overlong"}
    data["dataset"] = {"path": str(file), **kept}  # this file, whatever the config names
    config = with_overrides(build_config(data, args.config or "defaults"), args.overrides)
    if parse_ref(args.name)[0] == f"{config.output}/data":
        raise ConfigError(
            f"{args.name!r} is where the run {config.output!r} publishes its own split",
            "publish under a name of its own, e.g. --name my-data, and set dataset.ref to it",
        )
    settings = TrainerSettings()
    report = check(config, settings, progress=sys.stderr.isatty())
    print(report.render())
    if report.exit_code == 3:
        print(f"not published: the preflight refused {file} (the lines above say why)")
        return 3
    with tempfile.TemporaryDirectory(prefix="lorastack-publish-") as tmp:
        folder = Path(tmp)
        shutil.copyfile(file, folder / file.name)
        from lorastack.store import open_store

        metadata: dict[str, object] = {"source": file.name, "preflight": report.verdict}
        manifest = publish_once(open_store(settings), folder, args.name, metadata)
    print(
        f"published {manifest.ref} ({manifest.digest[:19]}): train on it with dataset.ref: {args.name}"
    )
    return 0


def register(sub: Any) -> None:
    """Add `publish` to the trainer's `lorastack data` (absent where the trainer is not
    installed: the preflight is its)."""
    data = sub.choices.get("data")
    if data is None:
        return
    (actions,) = [a for a in data._actions if isinstance(a, argparse._SubParsersAction)]
    p = actions.add_parser(
        "publish",
        help="check a chat JSONL file as `data check` does, then publish it as a dataset",
        description="Preflight FILE against the run config (--config, else the defaults) "
        "and publish it to the store as the dataset NAME; refused by the preflight "
        "(exit 3), nothing is published.",
    )
    p.add_argument("file", metavar="FILE", help="chat JSONL (OpenAI fine-tuning format)")
    p.add_argument("--name", required=True, help="dataset name in the store, e.g. my-data")
    p.add_argument("--config", help="the run config it will train with (base model, lengths)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. max_seq_len=1024")
    p.set_defaults(handler=cmd_publish)
