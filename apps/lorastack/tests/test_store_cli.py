"""`lorastack store get` on a hostile manifest (its first file's path edited to climb out of
the cache, the digest recomputed to match): the command prints the error naming the field
and what to do, exits non-zero with no traceback, and writes nothing outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lorastack.manifest import FileEntry, content_digest
from lorastack.settings import CommonSettings
from lorastack.store import open_store
from lorastack.store.backend import manifest_key


def test_store_get_refuses_a_hostile_manifest_without_a_traceback(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = open_store(CommonSettings(home=home))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    store.publish(src, kind="dataset", name="demo/data", service="test")
    key = Path(store.url.removeprefix("file://")) / manifest_key("demo/data", "1")
    m = json.loads(key.read_bytes())
    m["files"][0]["path"] = "../../../escaped.txt"
    m["digest"] = content_digest([FileEntry.model_validate(f) for f in m["files"]])
    key.write_text(json.dumps(m))
    env = {**os.environ, "LORASTACK_HOME": str(home)}
    env.pop("LORASTACK_STORE_URL", None)
    out = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "store", "get", "demo/data", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0
    assert "files[0].path '../../../escaped.txt' is not a relative, normalised path" in out.stderr
    assert "hint: the manifest was edited or damaged in the store" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not list(tmp_path.rglob("escaped.txt")) and not (tmp_path / "d").exists()
