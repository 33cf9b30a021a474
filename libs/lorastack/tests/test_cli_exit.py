"""The console script ends its process at once (no interpreter teardown) yet loses no
output and keeps the command's exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorastack.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_piped_output_and_exit_code_survive_the_fast_exit(tmp_path: Path) -> None:
    out = tmp_path / "demo.jsonl"
    done = run("data", "make-demo", str(out))
    assert done.returncode == 0, done.stderr
    # stdout is a pipe here (block-buffered): both lines arrive only if it was flushed
    assert done.stdout.startswith(f"wrote 200 conversations to {out}\n")
    assert "e.g. user:" in done.stdout
    assert len(out.read_text().splitlines()) == 200
    failed = run("train", str(tmp_path / "missing.yaml"))
    assert failed.returncode == 2
    assert "error: config file" in failed.stderr and "hint:" in failed.stderr
