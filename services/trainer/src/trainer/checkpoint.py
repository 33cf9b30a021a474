"""Checkpoints and the run manifest that guards `--resume`.

A checkpoint folder `step-NNNNNNNN/` holds `adapter/` (adapter_config.json +
adapter_model.safetensors), `optimizer.pt`, `scheduler.pt`, `rng.pt` (torch, CUDA,
python and numpy states), `trainer-state.json` (step = data position: the batch order is
derived from (seed, epoch), so the step fixes it) and `run-manifest.json`. It is written
into a temporary folder, fsynced, then renamed: a reader never sees a torn checkpoint.

`manifest_diff` compares two run manifests and returns what changed, ignoring the
config fields declared safe to change (config.SAFE_TO_CHANGE).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import SAFE_TO_CHANGE

PREFIX = "step-"
NOT_COMPARED = frozenset({"git_commit"})  # informational: other services' commits move HEAD


def code_version() -> str:
    """The trainer version plus a hash of its sources (the CLI aside): what decides the numbers."""
    import hashlib

    from trainer import __version__

    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        if f.name == "cli.py":
            continue
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return f"trainer {__version__} src:{h.hexdigest()[:16]}"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def local_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(p.name[len(PREFIX) :]) for p in root.glob(f"{PREFIX}*") if p.is_dir())


def rng_states() -> dict[str, Any]:
    py = random.getstate()
    np_state: Any = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    v, internal, gauss = states["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    run_manifest: dict[str, Any],
) -> Path:
    """Write checkpoint `step` atomically under `root`; returns its folder."""
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "adapter")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_states(), tmp / "rng.pt")
    (tmp / "trainer-state.json").write_text(json.dumps({"step": step, **state}, indent=1) + "\n")
    (tmp / "run-manifest.json").write_text(
        json.dumps(run_manifest, indent=1, sort_keys=True) + "\n"
    )
    _fsync_tree(tmp)
    if final.exists():  # the same step written again (a resumed run): replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def load_into(
    folder: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Restore adapter, optimizer and scheduler from `folder`; returns trainer-state.
    Call `set_rng_states(load_rng(folder))` last, after everything that draws numbers."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise RuntimeError(f"checkpoint {folder} has unexpected adapter keys {unexpected[:3]}")
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    state: dict[str, Any] = json.loads((folder / "trainer-state.json").read_text())
    return state


def load_rng(folder: Path) -> dict[str, Any]:
    states: dict[str, Any] = torch.load(folder / "rng.pt", weights_only=True)
    return states


def read_manifest(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "run-manifest.json").read_text())
    return data


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): d}


def manifest_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human lines for every difference that makes a resume unsafe."""
    lines: list[str] = []
    for key in sorted(set(old) | set(new)):
        if key == "config" or key in NOT_COMPARED:
            continue
        if old.get(key) != new.get(key):
            if isinstance(old.get(key), dict) or isinstance(new.get(key), dict):
                a, b = _flatten(old.get(key) or {}), _flatten(new.get(key) or {})
                for sub in sorted(set(a) | set(b)):
                    if a.get(sub) != b.get(sub):
                        lines.append(f"{key}.{sub}: {a.get(sub)!r} -> {b.get(sub)!r}")
            else:
                lines.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    a, b = _flatten(old.get("config", {})), _flatten(new.get("config", {}))
    for sub in sorted(set(a) | set(b)):
        if sub.split(".")[0] in SAFE_TO_CHANGE or sub == "output":
            continue
        if a.get(sub) != b.get(sub):
            lines.append(f"config.{sub}: {a.get(sub)!r} -> {b.get(sub)!r}")
    return [ln for ln in lines if not ln.startswith("config_hash")] if lines else lines
