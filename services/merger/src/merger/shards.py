"""Merge an adapter into a base shard by shard: the merger's weight I/O.

    merge_shards(base_dir, adapter_dir, out_dir, plan, dtype="bfloat16", device="cuda")

For each safetensors shard of the base (the same shard layout and index json come out):
open it lazily (`safe_open`), take its tensors one at a time, add the LoRA deltas of
those that have one in float32 on `device` (lorastack.merger.lora says which and how),
cast to the output dtype, and stream the bytes into the output shard at once; a tensor
is released before the next is read. The output header is written first, from the
base's shapes and the output dtype, so a shard never has to be held whole (safetensors'
`save_file` takes a dict of every tensor of a file). Peak host memory: the pages of the
shard being read (a file mapping the kernel may drop) + one tensor + the adapter.

`ShardReader` is the seam where base tensors come in: the default reads with
safetensors; a test passes one that counts how many are alive at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from lorastack.errors import ConfigError
from merger.lora import LoraPlan, Update

INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPES = {  # safetensors header names
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class ShardFile(Protocol):
    """The part of a safetensors file handle the merge reads."""

    def keys(self) -> list[str]:
        """The names of the tensors in the file."""

    def get_slice(self, name: str) -> Any:
        """A lazy slice of the tensor `name` (read only when indexed)."""

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""

    def metadata(self) -> dict[str, str] | None:
        """The file's header metadata, if any."""


ShardReader = Callable[[Path], AbstractContextManager[ShardFile]]


@contextmanager
def read_shard(path: Path) -> Iterator[ShardFile]:
    """The default reader: safetensors' lazy view of one file (tensors read on demand)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        yield f


def base_shards(base_dir: Path) -> list[str]:
    """The base's shard file names, in index order (one file when it has no index)."""
    index = base_dir / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    files = sorted(p.name for p in base_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ConfigError(
            f"the base holds {len(files)} safetensors files and no {INDEX}",
            "publish the base as transformers saves it (one file, or shards with an index)",
        )
    return files


def header_of(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets): no data."""
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")  # header length, bytes
        header: dict[str, Any] = json.loads(fh.read(n))
    return header


def base_layout(base_dir: Path) -> dict[str, dict[str, Any]]:
    """shard file -> its header, for every shard of the base."""
    return {name: header_of(base_dir / name) for name in base_shards(base_dir)}


def base_dtype(layout: dict[str, dict[str, Any]]) -> str:
    """The float dtype most of the base's weights are stored in (read from the files)."""
    sizes: dict[str, int] = {}
    for header in layout.values():
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] in FLOAT_NAMES:
                a, b = info["data_offsets"]
                sizes[info["dtype"]] = sizes.get(info["dtype"], 0) + b - a
    if not sizes:
        raise ConfigError("the base has no float weights", "merge into a float base model")
    return FLOAT_NAMES[max(sizes, key=lambda k: sizes[k])]


def out_dtype_of(stored: str, dtype: str) -> str:
    """A float tensor takes the output dtype; others (int buffers) keep theirs."""
    return ST_DTYPES[DTYPES[dtype]] if stored in FLOAT_NAMES else stored


_ITEMSIZE = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}


def output_bytes(layout: dict[str, dict[str, Any]], dtype: str) -> int:
    """Bytes of the merged shards' tensors in `dtype` (headers aside)."""
    total = 0
    for header in layout.values():
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            total += numel * _ITEMSIZE.get(out_dtype_of(info["dtype"], dtype), 1)
    return total


class _StreamedShard:
    """A safetensors file written tensor by tensor in a fixed order: the header (every
    offset known from the shapes) first, then each tensor's bytes as they come."""

    def __init__(self, path: Path, entries: list[tuple[str, str, list[int]]], meta: Any) -> None:
        header: dict[str, Any] = {"__metadata__": meta or {"format": "pt"}}
        offset = 0
        self.order: list[tuple[str, int]] = []
        for name, st_dtype, shape in entries:
            numel = 1
            for d in shape:
                numel *= d
            size = numel * _ITEMSIZE.get(st_dtype, 1)
            header[name] = {
                "dtype": st_dtype,
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            self.order.append((name, size))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        self.fh = path.open("wb")
        self.fh.write(len(raw).to_bytes(8, "little") + raw)
        self.next = 0
        self.tensor_bytes = 0  # written so far, headers aside

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, size = self.order[self.next]
        if name != expected:
            raise RuntimeError(f"shard written out of order: {name} before {expected}")
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != size:
            raise RuntimeError(f"{name}: {data.numel()} bytes, header says {size}")
        self.fh.write(data.numpy().data)  # the tensor's bytes, no copy
        self.next += 1
        self.tensor_bytes += size

    def close(self) -> None:
        self.fh.close()
        if self.next != len(self.order):
            raise RuntimeError(f"shard closed after {self.next} of {len(self.order)} tensors")


@dataclass
class ShardStats:
    """Counts of the shard-by-shard merge: files, tensors, merged tensors, bytes."""

    shards: int = 0
    tensors: int = 0
    merged: int = 0  # tensors that took a LoRA delta or a copy
    bytes_written: int = 0
    tensor_bytes: int = 0  # the index's total_size


def apply_update(
    weight: torch.Tensor,
    update: Update,
    adapter: dict[str, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The base tensor with its update applied, float32, on `device`. The same arithmetic
    as PEFT's merge in float32: W + (B @ A) * scaling, one module at a time."""
    if update.copy is not None:
        return adapter[update.copy].to(device=device, dtype=torch.float32)
    w = weight.to(device=device, dtype=torch.float32)
    for a_name, b_name, scaling, embedding in update.loras:
        a = adapter[a_name].to(device=device, dtype=torch.float32)
        b = adapter[b_name].to(device=device, dtype=torch.float32)
        delta = (b @ a) * scaling
        w += delta.T if embedding else delta
        del delta
    return w


def merge_shards(
    base_dir: Path,
    adapter: dict[str, torch.Tensor],
    out_dir: Path,
    plan: LoraPlan,
    dtype: str,
    device: torch.device,
    reader: ShardReader = read_shard,
) -> ShardStats:
    """Write the merged shards and index into `out_dir` (see the module docstring)."""
    out_t = DTYPES[dtype]
    stats = ShardStats()
    weight_map: dict[str, str] = {}
    for shard in base_shards(base_dir):
        with reader(base_dir / shard) as f:
            names = list(f.keys())
            entries = []
            for name in names:
                sl = f.get_slice(name)
                entries.append((name, out_dtype_of(sl.get_dtype(), dtype), list(sl.get_shape())))
            out = _StreamedShard(out_dir / shard, entries, f.metadata())
            try:
                for name in names:
                    t = f.get_tensor(name)
                    update = plan.updates.get(name)
                    if update is not None:
                        t = apply_update(t, update, adapter, device)
                        stats.merged += 1
                    if t.is_floating_point():
                        t = t.to(out_t)
                    out.write(name, t.cpu())
                    del t  # one base tensor at a time
                    weight_map[name] = shard
                    stats.tensors += 1
            finally:
                out.close()
            stats.tensor_bytes += out.tensor_bytes
        stats.shards += 1
        stats.bytes_written += (out_dir / shard).stat().st_size
    if (base_dir / INDEX).is_file():
        index = {
            "metadata": {"total_size": stats.tensor_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        stats.bytes_written += (out_dir / INDEX).stat().st_size
    return stats


def load_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """adapter_config.json and every tensor of adapter_model.safetensors (a few hundred MB
    at most: r=16 on every linear layer of an 8B is 168 MB in float32)."""
    from safetensors.torch import load_file

    cfg_path = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise ConfigError(
            f"{adapter_dir} lacks adapter_config.json or adapter_model.safetensors",
            "publish the folder peft's save_pretrained writes",
        )
    config: dict[str, Any] = json.loads(cfg_path.read_text())
    return config, load_file(str(weights))


def pick_device(choice: str) -> torch.device:
    """auto: the GPU when torch sees one, else the CPU; cuda without one is a ConfigError."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda, but torch sees no CUDA device",
            "use --device auto or cpu (LORASTACK_MERGE_DEVICE)",
        )
    return torch.device("cuda", torch.cuda.current_device())
