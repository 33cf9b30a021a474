"""`lorastack doctor`: pins against what is installed, and the CLI's exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lorastack.doctor import check_package, read_pins


def test_pins_are_read_and_mismatches_explained(tmp_path: Path) -> None:
    (tmp_path / "constraints.txt").write_text("# pins\nPyYAML==1.0\ntorch==2.13.0\n")
    pins = read_pins(tmp_path / "constraints.txt")
    assert pins == {"pyyaml": "1.0", "torch": "2.13.0"}
    row = check_package("pyyaml", "settings", pins)
    assert row.status == "warn" and "1.0 pinned" in row.detail and "constraints" in row.hint
    assert check_package("torch", "trainer", pins).status == "ok"  # 2.13.0+cpu matches 2.13.0
    missing = check_package("no-such-dist", "nothing", pins)
    assert missing.status == "warn" and "not installed" in missing.detail


def test_doctor_runs_and_reports_json(home: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert out.returncode == 0, out.stdout
    assert rows["python"]["status"] in ("ok", "warn")
    assert rows["store"]["status"] == "ok" and str(home) in rows["store"]["detail"]
