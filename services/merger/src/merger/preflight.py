"""Before any merge work: does it fit? Bytes to write against free disk, host memory and
GPU memory needed against what is available, refused at once with the numbers and the
option that helps.

`check_fit(need, have)` is pure; `measure(need, device)` reads the machine (shutil,
psutil, torch.cuda); `need_for(...)` computes what a merge needs from the base's
headers. The merge writes its shards into the merge folder, then publishing links them
into a file:// store on the same file system (no second copy: ArtifactStore.publish's
hand_over) or copies them into one on another (an s3:// store takes them over the
network: no local disk).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from lorastack.errors import Refused

GB = 1e9
DISK_MARGIN = 256 << 20  # bytes: config, tokenizer, report, index, and file-system slack
GPU_MARGIN = 2 << 30  # bytes: CUDA context, matmul workspaces, probe activations and logits


@dataclass(frozen=True)
class Need:
    """What a merge will take: bytes on each file system, host memory, GPU memory."""

    disk: dict[Path, int]  # folder -> bytes written under it (a folder per file system)
    host_ram: int  # bytes
    gpu_mem: int  # bytes; 0 on the CPU


@dataclass(frozen=True)
class Have:
    """What the machine has free, for the same folders and memories as a Need."""

    disk_free: dict[Path, int]  # the same folders -> bytes free on their file system
    host_ram: int  # bytes available (psutil: without swapping)
    gpu_mem: int | None  # bytes free on the device; None on the CPU


@dataclass(frozen=True)
class Sizes:
    """What a merge handles, in bytes (from the base's safetensors headers)."""

    output: int  # the merged shards in the output dtype
    largest_shard: int  # the base's largest shard as stored (read one at a time)
    adapter: int  # adapter_model.safetensors
    params: int  # parameters of the base: the verification model holds them in float32
    out_itemsize: int = 4  # bytes per element of the output dtype
    notes: list[str] = field(default_factory=list)


def _existing(path: Path) -> Path:
    """The nearest folder that exists: disk_usage needs one, and it is on the same disk."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def need_for(
    sizes: Sizes, merge_dir: Path, store_dir: Path | None, on_gpu: bool, linked: bool = False
) -> Need:
    """merge folder: the output; a file:// store: a copy of it (publish), or only the
    small files when `linked` (on the merge folder's file system the shards are hard-linked
    in); verification holds the base + adapter in float32 on the device that runs it, and
    the merge reads one base shard + the adapter on the host."""
    disk: dict[Path, int] = {merge_dir: sizes.output + DISK_MARGIN}
    if store_dir is not None:
        disk[store_dir] = DISK_MARGIN if linked else sizes.output + DISK_MARGIN
    model = 4 * sizes.params + 2 * sizes.adapter  # float32 + the adapter as PEFT loads it
    host = sizes.largest_shard + sizes.adapter
    if not on_gpu:
        host += model
    return Need(disk=disk, host_ram=host, gpu_mem=model + GPU_MARGIN if on_gpu else 0)


def one_file_system(a: Path, b: Path) -> bool:
    """Whether two folders (or the nearest ones that exist) share a file system."""
    return _existing(a).stat().st_dev == _existing(b).stat().st_dev


def same_disk(need: Need) -> Need:
    """Folders on one file system add up (the first one carries the sum)."""
    by_dev: dict[int, Path] = {}
    disk: dict[Path, int] = {}
    for folder, n in need.disk.items():
        dev = _existing(folder).stat().st_dev
        first = by_dev.setdefault(dev, folder)
        disk[first] = disk.get(first, 0) + n
    return Need(disk=disk, host_ram=need.host_ram, gpu_mem=need.gpu_mem)


def measure(need: Need, device: str) -> Have:
    """Measure free disk, host memory and (on CUDA) GPU memory for `need`."""
    import psutil

    free = {f: shutil.disk_usage(_existing(f)).free for f in need.disk}
    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = int(torch.cuda.mem_get_info(torch.device(device))[0])
    return Have(disk_free=free, host_ram=int(psutil.virtual_memory().available), gpu_mem=gpu)


def check_fit(need: Need, have: Have, dtype: str, on_gpu: bool) -> None:
    """Refused with every shortfall and what helps; nothing when it all fits."""
    short: list[str] = []
    helps: list[str] = []
    for folder, n in need.disk.items():
        free = have.disk_free.get(folder, 0)
        if n > free:
            short.append(f"disk: needs {n / GB:.1f} GB under {folder}, free {free / GB:.1f} GB")
    if short:
        helps.append("free disk space, or point LORASTACK_MERGE_DIR at a disk with room")
        if dtype == "float32":
            helps.append("merge with --dtype bfloat16 (half the bytes; what vLLM serves)")
    if need.host_ram > have.host_ram:
        short.append(
            f"host memory: needs {need.host_ram / GB:.1f} GB, available {have.host_ram / GB:.1f} GB"
        )
        helps.append(
            "close other programs, or merge on a GPU (--device cuda): verification then holds "
            "the model in GPU memory"
            if not on_gpu
            else "close other programs, or use a machine with more memory"
        )
    if on_gpu and have.gpu_mem is not None and need.gpu_mem > have.gpu_mem:
        short.append(
            f"GPU memory: needs {need.gpu_mem / GB:.1f} GB (the model in float32 for "
            f"verification), free {have.gpu_mem / GB:.1f} GB"
        )
        helps.append("free the GPU (stop vLLM or training), or merge with --device cpu")
    if short:
        raise Refused("the merge does not fit: " + "; ".join(short), "; or ".join(helps))
