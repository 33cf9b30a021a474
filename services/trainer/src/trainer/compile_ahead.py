"""Compiling ahead: a child process fills this machine's compile cache with the run's
layer graph while the run itself prepares its data and loads its base.

A cold compile of one decoder layer's graph (inductor and Triton) holds the first
compiled step for many seconds; a warm on-disk cache takes a fraction of that
(bench/trainer/README.md has the figures). `start` launches
`python -m trainer.compile_ahead SPEC` at the beginning of a run that may compile its
layers (packed rows: one shape for the whole run) when the cache has not seen that graph
yet. The child builds a one-layer copy of the base (its widths, random weights, a
256-token vocabulary: the embeddings and the head are not in the layer's graph), loads
it with the run's own `load_model`, compiles it with `compile_decoder` and runs one step
on packed rows of the run's shape, so its graphs land in the FX, AOT autograd and Triton
caches under the run's cache folder. The run steps on eagerly until the child is done
(trainer.model.compiling.CompileRun), then compiles, taking the graphs from the cache. The
child is best-effort: if it fails or takes too long, the run compiles them itself, and
says why.

It stands beside trainer.assembly, above trainer.model and trainer.data: the child builds
a batch the way the data package collates packed rows and compiles it the way the model
package does. The handle on the child (`Ahead`: done yet, wait, stop) is
trainer.model.ahead, which the compiler (trainer.model.compiling.CompileRun) waits on.

Not ahead: unpacked batches (their width varies), auto-batch (the child would hold GPU
memory while the probe measures it), several processes, the whole-decoder scope.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import RunConfig
from trainer.model.ahead import Ahead

if TYPE_CHECKING:
    import torch

    from trainer.settings import TrainerSettings

VOCAB = 256  # the copy's vocabulary: only the layer's widths shape its graph


def _may_help(
    cfg: RunConfig, settings: TrainerSettings, mode: str, device: torch.device, auto_batch: bool
) -> bool:
    """Whether a compile ahead is wanted and can help this run (see the module docstring)."""
    from trainer.model.compiling import use_compile

    wanted = settings.compile_ahead
    if wanted is None:
        wanted = device.type == "cuda"
    return not (
        not wanted
        or not cfg.packing
        or auto_batch
        or settings.world_size > 1
        or mode != "train"
        or cfg.compile_scope == "decoder"
        or not use_compile(cfg, device)
    )


def start(
    cfg: RunConfig,
    settings: TrainerSettings,
    mode: str,
    run_dir: Path,
    model_config: dict[str, Any],
    device: torch.device,
    auto_batch: bool,
) -> Ahead | None:
    """Launch the child where it can help (see the module docstring), else None; it
    writes its spec and log into `run_dir`."""
    import torch

    from trainer.model.compiling import graph_key, is_warm

    if not _may_help(cfg, settings, mode, device, auto_batch):
        return None
    cache = settings.resolved_cache_dir / "torch-compile"
    key = graph_key(model_config, cfg, "layers")
    if is_warm(cache, key):
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "model_config": model_config,
        "run": cfg.model_dump(mode="json"),
        "device": str(device),
        "cache_dir": str(cache),
        "key": key,
        "threads": torch.get_num_threads(),  # inductor's CPU code (and cache key) follow it
    }
    spec_path = run_dir / "compile-ahead.json"
    spec_path.write_text(json.dumps(spec))
    log = run_dir / "compile-ahead.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.compile_ahead", str(spec_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Ahead(proc, log, time.monotonic())


def one_layer_copy(model_config: dict[str, Any], folder: Path, device: Any) -> None:
    """Save a random one-layer model of the base's widths into `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model.modeling import compute_dtype

    small = dict(model_config, num_hidden_layers=1, vocab_size=VOCAB)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
        small.pop(k, None)
    if isinstance(small.get("layer_types"), list):
        small["layer_types"] = small["layer_types"][:1]
    (folder / "config.json").write_text(json.dumps(small))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(folder), dtype=compute_dtype(device)
        )
    model.save_pretrained(folder)


def packed_rows(micro_batch: int, width: int) -> dict[str, Any]:
    """A micro-batch as the run collates its packed rows: two samples a row."""
    import torch

    from trainer.data.packing import collate_rows
    from trainer.data.samples import Sample

    half = width // 2
    ids = torch.randint(0, VOCAB, (half,)).tolist()
    sample = Sample(input_ids=ids, labels=ids, parts={}, rendered="", offsets=[])
    return collate_rows([[sample, sample]] * micro_batch, 0, width)


def main(spec_path: str) -> int:
    """The child's work: compile the layer graph SPEC describes into the cache; the exit code."""
    import torch

    from trainer.model.compiling import (
        compile_decoder,
        mark_dynamic_samples,
        mark_warm,
        use_cache_dir,
    )
    from trainer.model.modeling import load_model, loss_sum

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    cache = use_cache_dir(Path(spec["cache_dir"]))
    config = RunConfig.model_validate(spec["run"])
    device = torch.device(spec["device"])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        one_layer_copy(spec["model_config"], Path(tmp), device)
        model = load_model(Path(tmp), config, device)
    compile_decoder(model, "layers")
    model.train()
    batch = {
        k: v.to(device) for k, v in packed_rows(config.micro_batch, config.max_seq_len).items()
    }
    mark_dynamic_samples(batch)
    ids, labels, pos, cu = (
        batch[k] for k in ("input_ids", "labels", "position_ids", "cu_seq_lens")
    )
    loss_sum(model, ids, None, labels, pos, cu).backward()
    mark_warm(cache, spec["key"])
    print(f"compiled the layer graph in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
