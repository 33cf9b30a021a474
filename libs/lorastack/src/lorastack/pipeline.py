"""`lorastack demo`: the main job on the embedded defaults, stage by stage.

Each stage prints what it did and where its output lives; a failing stage stops the
run with the error's hint. Stages are added here as the services grow.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from lorastack.settings import CommonSettings
from lorastack.store import open_store


def stage(name: str, fn: Callable[[], Any], timings: dict[str, float]) -> Any:
    print(f"\n== {name}", flush=True)
    start = time.monotonic()
    result = fn()
    timings[name] = time.monotonic() - start
    print(f"   done in {timings[name]:.1f} s", flush=True)
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    from lorastack.base_model import import_default

    settings = CommonSettings()
    timings: dict[str, float] = {}
    base = stage("import the default base model", lambda: import_default(settings), timings)
    print(f"   {base.ref} {base.digest[:19]}")
    store = open_store(settings)
    print(f"\n== artifacts in {store.url}")
    for m in store.ls():
        print(f"   {m.ref:40} {m.kind}")
    print("\n== timings (s): " + ", ".join(f"{k}: {v:.1f}" for k, v in timings.items()))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded defaults")
    p.set_defaults(handler=cmd_demo)
