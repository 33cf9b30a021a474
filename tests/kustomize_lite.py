"""A small offline renderer for our Kustomize files (no kubectl here).

Supports what deploy/k8s uses and nothing more: `resources` (files or directories with a
kustomization.yaml), `namespace`, `labels` (without selectors) and strategic-merge
`patches` by path, where lists of named items (containers, env, ports, volumes) merge by
`name`. An unsupported key fails loudly instead of rendering something else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        by_name = {x["name"]: x for x in base}
        out_list = [merge(by_name[x["name"]], x) if x["name"] in by_name else x for x in patch]
        patched = {x["name"] for x in patch}
        return [x for x in base if x["name"] not in patched] + out_list
    return patch


def render(folder: Path) -> list[dict[str, Any]]:
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kust) - SUPPORTED
    if unknown:
        raise ValueError(f"{folder}: unsupported kustomization keys {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = folder / res
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in kust.get("patches", []):
        patch = yaml.safe_load((folder / p["path"]).read_text())
        target = next(
            (
                d
                for d in docs
                if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]
            ),
            None,
        )
        if target is None:
            raise ValueError(f"patch {p['path']} matches no resource")
        docs[docs.index(target)] = merge(target, patch)
    if "namespace" in kust:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = kust["namespace"]
    for group in kust.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(group["pairs"])
    return docs
