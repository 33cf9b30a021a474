"""Checkpoints and the run manifest that guards `--resume`.

A checkpoint folder `step-NNNNNNNN/` holds `adapter/` (adapter_config.json +
adapter_model.safetensors), `optimizer.pt` (keyed by parameter name under FSDP),
`scheduler.pt`, `rng.pt` (torch, CUDA, python and numpy states), `trainer-state.json`
(step = data position: the batch order is derived from (seed, epoch), so the step fixes
it) and `run-manifest.json`. It is written into a temporary folder, fsynced, then
renamed: a reader never sees a torn checkpoint. A process killed at any moment (kill -9
included) leaves the step folders whole: what it was writing stays a `.tmp-*` folder,
what it was removing was renamed to `.trash-*` first, and `local_steps` clears both
(putting back a step a rewrite had set aside). A write that fails (disk full) removes its
temporary folder and raises CheckpointWriteFailed: the previous checkpoint stays the
latest.

`manifest_diff` compares two run manifests and returns what changed, ignoring the
config fields declared safe to change (config.SAFE_TO_CHANGE) and the config fields the
old manifest lacks that hold their default now (added to the schema since).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import SAFE_TO_CHANGE, is_default
from trainer.errors import CheckpointWriteFailed
from trainer.model import sharding
from trainer.model.sharding import Gathered

PREFIX = "step-"
NOT_COMPARED = frozenset({"git_commit"})  # informational: other services' commits move HEAD


def code_version() -> str:
    """The trainer version plus a hash of its sources (the CLI aside): what decides the numbers."""
    import hashlib

    from trainer import __version__

    h = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]  # trainer/, every subpackage included
    for f in sorted(package.rglob("*.py")):
        name = f.relative_to(package).as_posix()
        if name == "cli.py":
            continue
        h.update(name.encode() + b"\0" + f.read_bytes())
    return f"trainer {__version__} src:{h.hexdigest()[:16]}"


def step_dir(root: Path, step: int) -> Path:
    """The checkpoint folder of `step` under `root`."""
    return root / f"{PREFIX}{step:08d}"


def local_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending (after `recover`)."""
    if not root.is_dir():
        return []
    recover(root)
    return sorted(int(p.name[len(PREFIX) :]) for p in root.glob(f"{PREFIX}*") if p.is_dir())


def prune(root: Path, keep: int, best: int | None) -> None:
    """Delete the local step folders but the newest `keep` and the step `best`."""
    for old in local_steps(root)[:-keep]:
        if old != best:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def recover(root: Path) -> None:
    """Clear what a killed writer left: put back a step folder a rewrite had renamed aside
    (`.trash-step-N-PID` while `step-N` is missing), then remove every `.tmp-*` and
    `.trash-*` folder. One writer per run folder (the main rank), so nothing is in use."""
    for trash in sorted(root.glob(f".trash-{PREFIX}*")):
        name = trash.name.removeprefix(".trash-").rsplit("-", 1)[0]
        if not (root / name).exists():
            os.rename(trash, root / name)
    for leftover in [*root.glob(f".tmp-{PREFIX}*"), *root.glob(f".trash-{PREFIX}*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def discard(folder: Path) -> None:
    """Remove a checkpoint folder; renamed first, so no reader ever meets it half deleted."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def rng_states() -> dict[str, Any]:
    """The torch, CUDA, Python and NumPy random states, for a checkpoint."""
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
    """Restore the torch, CUDA, Python and NumPy random states saved in a checkpoint."""
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
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Flush `folder`'s entries (its files' names) to disk."""
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
    gathered: Gathered | None = None,
) -> Path:
    """Write checkpoint `step` atomically under `root`; returns its folder. `gathered`:
    the adapter and optimizer state of a sharded model, gathered whole (trainer.model.sharding).
    Raises CheckpointWriteFailed (nothing written, the previous checkpoints untouched) when
    the disk is full or another OS error stops the write."""
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        if gathered is None:
            model.save_pretrained(tmp / "adapter")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        else:  # a normal PEFT adapter all the same
            model.save_pretrained(tmp / "adapter", state_dict=gathered.adapter)
            torch.save(gathered.optimizer, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_states(), tmp / "rng.pt")
        (tmp / "trainer-state.json").write_text(
            json.dumps({"step": step, **state}, indent=1) + "\n"
        )
        (tmp / "run-manifest.json").write_text(
            json.dumps(run_manifest, indent=1, sort_keys=True) + "\n"
        )
        _fsync_tree(tmp)  # delayed allocation: a full disk may only show here
    except (OSError, RuntimeError) as e:  # torch.save wraps the OSError in a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(e, root, step) from e
    if final.exists():  # the same step written again (a resumed run): swap, never delete first
        aside = root / f".trash-{final.name}-{os.getpid()}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    return final


def _write_failed(e: BaseException, root: Path, step: int) -> CheckpointWriteFailed:
    """The error of checkpoint `step` not written under `root`: what stopped it, and the
    latest checkpoint that is intact."""
    latest = max((int(p.name[len(PREFIX) :]) for p in root.glob(f"{PREFIX}*")), default=None)
    kept = f"checkpoint step {latest} is intact" if latest is not None else "no checkpoint"
    full = _is_disk_full(e)
    return CheckpointWriteFailed(
        f"could not write checkpoint step {step} under {root}: "
        + ("the disk is full" if full else f"{type(e).__name__}: {e}")
        + f"; nothing of it was kept, {kept}",
        ("free space on that disk (or lower keep_checkpoints), then " if full else "")
        + "continue with the same command plus --resume",
    )


def _is_disk_full(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def load_adapter(folder: Path, model: Any) -> None:
    """Put the adapter weights of checkpoint `folder` into `model`."""
    from peft import set_peft_model_state_dict

    weights = _adapter_weights(folder)
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise RuntimeError(f"checkpoint {folder} has unexpected adapter keys {unexpected[:3]}")


def _adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def load_into(
    folder: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, root: Any = None
) -> dict[str, Any]:
    """Restore adapter, optimizer and scheduler from `folder`; returns trainer-state.
    `root`: the module training calls, sharded by FSDP or not (trainer.model.sharding).
    Call `set_rng_states(load_rng(folder))` last, after everything that draws numbers."""
    optim_state = torch.load(folder / "optimizer.pt", weights_only=True)
    if sharding.is_sharded(root):
        sharding.load(root, model, optimizer, _adapter_weights(folder), optim_state, str(folder))
    else:
        load_adapter(folder, model)
        optimizer.load_state_dict(optim_state)
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    state: dict[str, Any] = json.loads((folder / "trainer-state.json").read_text())
    return state


def load_rng(folder: Path) -> dict[str, Any]:
    """The random states saved in the checkpoint `folder` (rng.pt)."""
    states: dict[str, Any] = torch.load(folder / "rng.pt", weights_only=True)
    return states


def read_manifest(folder: Path) -> dict[str, Any]:
    """The run manifest saved in the checkpoint `folder`, parsed."""
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
        if sub not in a and is_default(sub, b[sub]):
            continue  # a field added since the old run was written, at its default
        if a.get(sub) != b.get(sub):
            lines.append(f"config.{sub}: {a.get(sub)!r} -> {b.get(sub)!r}")
    return [ln for ln in lines if not ln.startswith("config_hash")] if lines else lines
