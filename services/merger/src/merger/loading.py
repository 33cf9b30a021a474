"""Loading the models a merge compares, in float32 on the merge's device: the base
(shard by shard, so one shard's pages are mapped at a time), base + adapter as a
PeftModel, its parameters cast to the output dtype, and the merged shards as written
read back into its base layers.

Owns: those loads and casts (torch, safetensors, transformers, peft). Does not own: what
is run on the models (probing.py), the merge itself (shards.py), the order (merge.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorastack.errors import ConfigError
from merger.shards import base_shards


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_base(base_dir: Path, device: Any) -> Any:
    """The base in float32 on `device`, its weights copied in shard by shard (one shard's
    pages mapped at a time: from_pretrained mapped every shard at once, 17.9 GB of host
    RSS for an 8B), every tensor of the model loaded or tied to a loaded one."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for shard in base_shards(base_dir):
            with safe_open(str(base_dir / shard), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    if name not in state:
                        raise ConfigError(
                            f"the base's tensor {name} is not in {type(model).__name__}",
                            "publish the base as transformers saves it",
                        )
                    state[name].copy_(f.get_tensor(name))
                    loaded.add(name)
    ptrs = {state[n].data_ptr() for n in loaded}
    missing = [n for n in state if n not in loaded and state[n].data_ptr() not in ptrs]
    if missing:
        raise ConfigError(
            f"the base has no weights for {', '.join(missing[:3])}",
            "publish the complete base model",
        )
    return model


def load_with_adapter(base_dir: Path, adapter_dir: Path, device: Any) -> Any:
    """Base + adapter in float32 on `device`, loaded once for every comparison."""
    from peft import PeftModel

    base = load_base(base_dir, device)
    try:
        model = PeftModel.from_pretrained(base, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(
            f"the adapter does not load onto its base: {str(e).splitlines()[0][:300]}",
            "the adapter was trained on another architecture or vocabulary; check its base "
            "parent with 'lorastack store show'",
        ) from e
    return model.eval()


def cast_parameters(model: Any, dtype: str) -> None:
    """Parameters to `dtype`, buffers (rotary frequencies) untouched: as from_pretrained
    in that dtype loads them."""
    t = _torch_dtype(dtype)
    for p in model.parameters():
        p.data = p.data.to(t)


def load_merged(model: Any, folder: Path) -> None:
    """Copy the merged shards as written into the base layers of the loaded PeftModel:
    with its adapter disabled it is then the merged model as it ships."""
    import torch
    from safetensors import safe_open

    base = model.get_base_model()
    with torch.no_grad():
        for shard in base_shards(folder):
            with safe_open(str(folder / shard), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    module_path, _, leaf = name.rpartition(".")
                    module = base.get_submodule(module_path)
                    module = (
                        getattr(module, "base_layer", None)
                        or getattr(module, "original_module", None)
                        or module
                    )
                    getattr(module, leaf).copy_(f.get_tensor(name))
